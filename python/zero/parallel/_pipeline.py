"""Pipeline parallelism composed with ZeRO (GPipe's and 1F1B's schedules,
torch.distributed.pipelining's engines): each rank of the mesh's `pp`
dimension holds one stage of the model, ZeRO partitions that stage over
the data-parallel dimensions, and torch's schedule streams micro-batches
through the stages.

[Note: pipeline stages] What zero adds to torch's pipelining:
- split_gpt / split_llama cut a model into stages by layers, keeping every
  parameter's name (blocks.5.q.weight stays blocks.5.q.weight: the blocks
  sit in a ModuleDict keyed by their index), so a checkpoint saved on one
  pipeline layout loads on any other, or in one process;
- pipeline_schedule builds torch's PipelineStage and schedule on the
  engine's stage with scale_grads=False and each micro-batch's loss
  divided by their number instead: zero's stages 2-3 move the gradients
  out of .grad during backward, where torch's scale_grads would not find
  them. The schedule's micro-batches are its accumulation: the engine
  steps once per batch (gradient_accumulation_steps 1). In fp16 the loss
  is multiplied by the engine's loss scale there too (the losses given
  back are unscaled);
- a head tied to the embedding (GPT-2, examples/gpt.py) lives on the first
  and the last stage; each holds a copy, the copies' gradients are summed
  at the step over the ranks that hold them (PipelineLayout.sum_ties), so
  both take the same update, as Megatron-LM does with its shared
  embedding; the last stage's copy is not written into checkpoints (it is
  the first stage's parameter under another name);
- the global gradient norm sums the stages (a tied copy counted once);
- under sequence parallelism ([Note: sequence parallelism]) a stage sends
  its tp rank's sequence shard of the hidden states (a plain tensor, to
  the same tp rank of the next stage) and turns the shard it receives
  back into the residual stream's DTensor.
"""
from __future__ import annotations

import torch
from torch import nn

from zero.parallel._micro_batches import MicroBatchShapes
from zero.parallel._plan_arguments import check_line, check_model
from zero.parallel._stage_info import StageInfo
from zero.parallel._tensor_parallel import vocabulary_parallel
from zero.parallel._virtual_stages import (MULTI_STAGE_SCHEDULES, is_chunked,
                                           multi_stage_schedule, split_into_chunks)


def _stage_of(pp_mesh):
    return pp_mesh.get_local_rank(), pp_mesh.size()


def layer_range(layers: int, index: int, count: int) -> range:
    """The layers stage `index` of `count` holds: contiguous, the first
    stages one more each when `count` does not divide `layers`."""
    if count > layers:
        raise ValueError(f"{count} pipeline stages for {layers} layers: each stage needs at "
                         "least one layer")
    per, extra = divmod(layers, count)
    start = index * per + min(index, extra)
    return range(start, start + per + (index < extra))


def _sequence_shards_in(stage, x):
    """The hidden states a stage receives, as its blocks take them: under
    sequence parallelism, this tp rank's sequence shard made the residual
    stream's DTensor (Shard(1), even shards: the first stage checked)."""
    mesh = getattr(stage, "_zero_sequence_parallel", None)
    if mesh is None:
        return x
    from torch.distributed.tensor import DTensor, Shard
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False)


def _check_sequence(stage, ids):
    """The first stage's check that tp divides the sequence length when the
    stages exchange sequence shards: uneven shards would be taken for
    even ones on the next stage."""
    mesh = getattr(stage, "_zero_sequence_parallel", None)
    if mesh is not None and not stage.last and ids.shape[1] % mesh.size():
        raise _uneven_sequence(ids.shape[1], mesh.size())


def _uneven_sequence(length: int, tp: int) -> ValueError:
    return ValueError(f"sequence length {length} is not divisible by the tp size ({tp}): "
                      "under sequence parallelism the pipeline stages exchange even sequence "
                      "shards")


def _local_tensor(x):
    """x's local tensor when it is a DTensor, else x: what a stage sends
    (under sequence parallelism its shard of the hidden states), and the
    losses handed back (under loss_parallel, replicated DTensors)."""
    return x.to_local() if hasattr(x, "to_local") else x


def _is_tied(first: nn.Module, first_name, last: nn.Module, last_name, count) -> bool:
    """Whether last.<last_name> is first.<first_name> (a tied head) on
    stages that differ: the last stage then gets a copy of its own."""
    return count > 1 and getattr(last, last_name) is getattr(first, first_name)


def _ties(index, count, tied, copy_name, canonical) -> dict:
    """A stage's StageInfo.ties: the first stage holds the parameter, the
    last its copy."""
    if not tied:
        return {}
    return {canonical: canonical} if index == 0 else \
        {copy_name: canonical} if index == count - 1 else {}


class GPTStage(nn.Module):
    """Stage `index` of `count` of examples/gpt.py's GPT: the embeddings on
    the first, its blocks, the final norm and head on the last. Its
    forward takes token ids (first stage) or the previous stage's hidden
    states, and gives hidden states or (last stage) the logits."""

    def __init__(self, model, index: int, count: int):
        super().__init__()
        self.cfg = model.cfg  # what parallelize_gpt checks the tp size against
        self.first, self.last = index == 0, index == count - 1
        tied = _is_tied(model.embed, "weight", model.head, "weight", count)
        if self.first:
            self.embed, self.pos = model.embed, model.pos
        self.blocks = nn.ModuleDict({str(i): model.blocks[i]
                                     for i in layer_range(len(model.blocks), index, count)})
        if self.last:
            self.ln, self.head = model.ln, model.head
            if tied:
                self.head.weight = nn.Parameter(model.embed.weight.detach().clone())
        self._zero_pipeline = StageInfo(index, count, _ties(index, count, tied, "head.weight",
                                                            "embed.weight"),
                                        ("embed.weight",) if tied else ())

    def forward(self, x):
        if self.first:
            _check_sequence(self, x)
            x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        else:
            x = _sequence_shards_in(self, x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln(x)) if self.last else _local_tensor(x)


def split_gpt(model: nn.Module, pp_mesh, stages_per_rank: int = 1) -> nn.Module:
    """This rank's stage of examples/gpt.py's GPT over `pp_mesh`
    (mesh["pp"]), by blocks; parameter names kept. stages_per_rank > 1:
    the model cut into pp x stages_per_rank stages, this rank's held by one
    module, for the interleaved schedules ([Note: stage chunks])."""
    check_line(pp_mesh, "pp_mesh", "pp")
    check_model(model, ("cfg", "blocks", "embed", "head"), "examples/gpt.py's GPT", "split_gpt")
    if type(stages_per_rank) is not int or stages_per_rank != 1:  # split_into_chunks checks
        return split_into_chunks(GPTStage, model, pp_mesh, stages_per_rank)
    index, count = _stage_of(pp_mesh)
    return GPTStage(model, index, count)


def gpt_loss(logits, labels):
    """examples/gpt.py's loss on a last stage's logits (labels are the next
    tokens)."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       labels.reshape(-1))


class _LlamaBody(nn.Module):
    """The `model` of a LlamaForCausalLM stage: its share of the layers,
    under their own indices, and the rotary embedding every stage needs."""
    _zero_layer_holder = True  # a rank's stages merge theirs ([Note: stage chunks])


class LlamaStage(nn.Module):
    """Stage `index` of `count` of a HuggingFace LlamaForCausalLM (and
    decoders laid out as it is): embed_tokens on the first, its decoder
    layers, the final norm and lm_head on the last. Causal attention
    through an explicit mask, so the eager and sdpa kernels both apply
    it. Its forward takes input ids or hidden states and gives hidden
    states or (last stage) the logits."""

    def __init__(self, model, index: int, count: int):
        super().__init__()
        base = model.model
        self.config = model.config  # what parallelize_llama checks the tp size against
        self.first, self.last = index == 0, index == count - 1
        tied = _is_tied(base.embed_tokens, "weight", model.lm_head, "weight", count)
        self.model = _LlamaBody()
        if self.first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in
                                           layer_range(len(base.layers), index, count)})
        self.model.rotary_emb = base.rotary_emb
        if self.last:
            self.model.norm = base.norm
            self.lm_head = model.lm_head
            if tied:
                self.lm_head.weight = nn.Parameter(base.embed_tokens.weight.detach().clone())
        canonical = "model.embed_tokens.weight"
        self._zero_pipeline = StageInfo(index, count, _ties(
            index, count, tied, "lm_head.weight", canonical), (canonical,) if tied else ())

    def forward(self, x):
        if self.first:
            _check_sequence(self, x)
        h = self.model.embed_tokens(x) if self.first else _sequence_shards_in(self, x)
        t = h.shape[1]
        positions = torch.arange(t, device=h.device).unsqueeze(0)
        rotary = self.model.rotary_emb(h, positions)
        mask = torch.full((t, t), float("-inf"), dtype=h.dtype, device=h.device).triu(1)
        mask = mask[None, None]
        for layer in self.model.layers.values():
            out = layer(h, attention_mask=mask, position_ids=positions,
                        position_embeddings=rotary)
            h = out[0] if isinstance(out, tuple) else out
        return self.lm_head(self.model.norm(h)) if self.last else _local_tensor(h)


def split_llama(model: nn.Module, pp_mesh, stages_per_rank: int = 1) -> nn.Module:
    """This rank's stage of a HuggingFace LlamaForCausalLM over `pp_mesh`,
    by decoder layers; parameter names kept. stages_per_rank: as in
    split_gpt."""
    check_line(pp_mesh, "pp_mesh", "pp")
    check_model(model, ("config", "model.layers", "lm_head"), "a HuggingFace Llama causal LM",
                "split_llama")
    if type(stages_per_rank) is not int or stages_per_rank != 1:  # split_into_chunks checks
        return split_into_chunks(LlamaStage, model, pp_mesh, stages_per_rank)
    index, count = _stage_of(pp_mesh)
    return LlamaStage(model, index, count)


def causal_lm_loss(logits, labels):
    """A HuggingFace causal LM's loss on a last stage's logits, with labels
    as HuggingFace takes them (the input ids: shifted here)."""
    return nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class _PerMicroBatch:
    """loss_fn divided by the number of micro-batches: the schedule's
    backwards then add up to the batch's mean ([Note: pipeline stages]);
    in fp16 also multiplied by the engine's loss scale, as engine.backward
    would (the schedule runs the backwards)."""

    def __init__(self, loss_fn, n, engine):
        self.loss_fn, self.n, self.engine = loss_fn, n, engine

    def __call__(self, output, target):
        return self.loss_fn(output, target) * (self.engine.loss_scale / self.n)


class _ScaledSteps:
    """The schedule's step, telling the engine its backwards were scaled
    (fp16: step() divides by the loss scale, which it refuses to do for a
    backward it did not scale), and giving the losses back unscaled. A
    stage whose logits stay split by vocabulary (parallelized with
    loss_parallel=True) runs the step under torch's loss_parallel(), where
    the schedule computes each micro-batch's loss and its backward; its
    losses come back as plain tensors. Under sequence parallelism the
    stages first agree that tp divides the sequence length (a refusal on
    the first stage alone would leave the others waiting for its sends)."""

    def __init__(self, engine, step, pp_mesh, n_microbatches):
        self.engine, self.step, self.pp_mesh = engine, step, pp_mesh
        self.shapes = MicroBatchShapes(n_microbatches, sends=pp_mesh.size() > 1)

    def _agree_on_sequence(self, args):
        tp_mesh = getattr(self.engine.module, "_zero_sequence_parallel", None)
        if tp_mesh is None or self.pp_mesh.size() == 1:
            return
        ids = args[0] if args and torch.is_tensor(args[0]) and args[0].dim() >= 2 else None
        odd = ids.shape[1] if ids is not None and ids.shape[1] % tp_mesh.size() else 0
        odd = max(self.engine._pipeline.comm.gather_scalars(odd))
        if odd:
            raise _uneven_sequence(odd, tp_mesh.size())

    def __call__(self, *args, losses=None, **kwargs):
        self.shapes.check(args, kwargs)
        self._agree_on_sequence(args)
        scale = self.engine.loss_scale
        with vocabulary_parallel(self.engine.module):
            out = self.step(*args, losses=losses, **kwargs)
        self.engine._scaled_backward = True
        if losses is not None:
            losses[:] = [_local_tensor(loss) for loss in losses]
            if scale != 1.0:
                losses[:] = [loss / scale for loss in losses]
        return out


SCHEDULES = ("gpipe", "1f1b")


def _check_schedule_class(schedule, chunked: bool):
    """A schedule class that takes as many stages as the rank holds."""
    if isinstance(schedule, str):
        return
    from torch.distributed.pipelining.schedules import (PipelineScheduleMulti,
                                                        PipelineScheduleSingle)
    want = PipelineScheduleMulti if chunked else PipelineScheduleSingle
    if not (isinstance(schedule, type) and issubclass(schedule, want)):
        held = "several stages a rank (split with stages_per_rank > 1)" if chunked else \
            "one stage a rank"
        raise ValueError(f"schedule {schedule!r} is not a {want.__name__} subclass, and the "
                         f"engine's model holds {held}")


def pipeline_schedule(engine, pp_mesh, n_microbatches: int, loss_fn, schedule=None):
    """torch's pipeline schedule over the engine's stage: `schedule` is
    "gpipe", "1f1b" (the default), or a torch.distributed.pipelining
    schedule class that takes a single stage; for a model split with
    stages_per_rank > 1, "interleaved-1f1b" (the default), "looped-bfs" or
    a multi-stage schedule class. Call schedule.step(ids) on the first
    stage's ranks, schedule.step(target=labels, losses=out) on the last's
    (out: each micro-batch's loss divided by n_microbatches; their sum is
    the batch's mean loss), schedule.step() on the others; then
    engine.step()."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    chunked = is_chunked(engine.module)
    if schedule is None:
        schedule = "interleaved-1f1b" if chunked else "1f1b"
    if isinstance(schedule, str) and not chunked and schedule not in SCHEDULES:
        hint = " (those take a model split with stages_per_rank > 1)" \
            if schedule in MULTI_STAGE_SCHEDULES else ""
        raise ValueError(f"schedule must be one of {SCHEDULES} or a schedule class, got "
                         f"{schedule!r}{hint}")
    _check_schedule_class(schedule, chunked)
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
    if engine.config.gradient_accumulation_steps != 1:
        raise ValueError("the pipeline's micro-batches are its accumulation: build the engine "
                         "with gradient_accumulation_steps=1 (it is "
                         f"{engine.config.gradient_accumulation_steps}) and call "
                         "engine.step() once per schedule.step()")
    per_micro_batch = _PerMicroBatch(loss_fn, n_microbatches, engine)
    if chunked:
        built = multi_stage_schedule(engine, pp_mesh, n_microbatches, per_micro_batch, schedule)
    else:
        if isinstance(schedule, str):
            schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        index, count = _stage_of(pp_mesh)
        stage = PipelineStage(engine.module, index, count, engine.device,
                              group=pp_mesh.get_group())
        built = schedule(stage, n_microbatches, loss_fn=per_micro_batch, scale_grads=False)
    built.step = _ScaledSteps(engine, built.step, pp_mesh, n_microbatches)
    return built


class PipelineLayout:
    """The engine's view of its stage: the pp group's Comm, the stage's
    tied copies, and the sizes of the parameters tied across stages."""

    def __init__(self, comm, info: StageInfo | None, params: dict, optimizer=None):
        """params: this stage's parameters by name (local tensors);
        optimizer: the stage's, whose groups a tied copy must share."""
        self.comm = comm
        self.index, self.count = comm.rank, comm.world
        self.ties = dict(info.ties) if info is not None else {}
        self.tied = tuple(info.tied) if info is not None else ()
        # every stage takes part in each tie's sum over pp: the sizes come
        # from the stages that hold it (the local ones, under tp)
        mine = [0] * len(self.tied)
        for name, canonical in self.ties.items():
            mine[self.tied.index(canonical)] = params[name].numel()
        rows = comm.gather_ints(mine) if self.tied and comm.world > 1 else [mine]
        self.tie_sizes = [max(column) for column in zip(*rows)] if self.tied else []
        if self.tied and comm.world > 1 and optimizer is not None:
            _check_ties_trained_alike(comm, self.ties, self.tied, params, optimizer)

    def canonical(self, name: str) -> str:
        """The name a checkpoint keeps `name` under (a tied copy: the
        parameter it copies)."""
        return self.ties.get(name, name)

    def is_copy(self, name: str) -> bool:
        return self.ties.get(name, name) != name

    def copies(self, name: str) -> int:
        """On how many stages `name` lives (a tied parameter: two)."""
        return 2 if name in self.ties else 1

    def sum_ties(self, groups, comm, partitions: bool):
        """Each tied parameter's gradient summed over its two stages, after
        the data-parallel reduction. On a stage that holds it, every rank
        puts the reduced elements it owns (its partition's; at stage 0 the
        first data-parallel rank's, with replicas the first replica's) into
        a buffer of the whole parameter, summed over the stage's data-
        parallel ranks; a sum over the pp group (the other stages give
        zeros) adds the two stages; each rank takes back its elements. The
        groups are the ones every engine has: no group of the tie's ranks
        alone (gloo hung making such groups after others that overlap)."""
        if self.count == 1 or not self.tied:
            return
        first_replica = comm.replicate is None or comm.replicate.rank == 0
        contributes = first_replica and (partitions or comm.rank == 0)
        dtype, device = groups[0].grad_part.dtype, groups[0].grad_part.device
        here = {canonical: name for name, canonical in self.ties.items()}
        for canonical, size in zip(self.tied, self.tie_sizes):
            whole = torch.zeros(size, dtype=dtype, device=device)
            pieces = []
            if canonical in here:
                for fg in groups:
                    for piece in fg.owned_pieces():
                        if piece[0] == here[canonical]:
                            pieces.append((fg, piece))
                if contributes:
                    for fg, (_n, lo, hi, offset) in pieces:
                        whole[lo:hi] = fg.grad_part[offset:offset + hi - lo]
                comm.everyone.all_reduce_sum(whole)
            self.comm.all_reduce_sum(whole)
            for fg, (_n, lo, hi, offset) in pieces:
                fg.grad_part[offset:offset + hi - lo] = whole[lo:hi]


def _check_ties_trained_alike(comm, ties, tied, params, optimizer):
    """[Note: tied copies alike] The two stages that hold a tied parameter
    (the embedding, and the head's copy on the last stage) sum its
    gradients, and must then apply the same update to it: a copy frozen
    while the embedding trained, or put in a param group of other settings
    (a learning rate, no weight decay by name), drifted from the parameter
    it copies, silently (a head 16% apart from its embedding after 3
    steps), where torch's one tensor has one setting. Compared over the pp
    group (every rank decides alike), refused before any step."""
    import zlib
    mine, shown = [0] * len(tied), {}
    for name, canonical in ties.items():
        p = params[name]
        group = next((gi for gi, g in enumerate(optimizer.param_groups)
                      if any(q is p for q in g["params"])), None)
        hyper = {} if group is None else \
            {k: v for k, v in optimizer.param_groups[group].items() if k != "params"}
        setting = (f"requires_grad={p.requires_grad}, param group {group}" +
                   "".join(f", {k}={v!r}" for k, v in sorted(hyper.items())))
        # + 1: 0 stands for a stage that does not hold the tie
        mine[tied.index(canonical)] = zlib.crc32(setting.encode()) + 1
        shown[canonical] = (name, setting)
    rows = comm.gather_ints(mine)
    for i, canonical in enumerate(tied):
        held = {row[i] for row in rows if row[i]}
        if len(held) > 1:
            name, setting = shown.get(canonical, (canonical, "not held on this stage"))
            raise ValueError(
                f"the tied parameter '{canonical}' is trained differently on the pipeline "
                f"stages that hold it (this stage holds it as '{name}', {setting}): frozen on "
                "one and not the other, or in another param group or group settings. The stages "
                "sum its gradients and must take the same update, as one tensor would: "
                "freeze it, or group it, alike on every stage")

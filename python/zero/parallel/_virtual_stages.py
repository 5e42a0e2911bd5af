"""More than one pipeline stage per rank, for torch's interleaved schedules
(Megatron-LM's interleaved 1F1B, looped BFS): the model is cut into
pp x stages_per_rank stages, and rank r holds stages r, r + pp, r + 2 pp,
... (the loop placement those schedules expect). Each stage computes less
per micro-batch, so the pipeline's bubble shrinks by stages_per_rank, for
as many more sends between ranks.

[Note: stage chunks] One engine trains all of a rank's stages, so they
must be one module: StageChunks holds the stages' layers under the
model's own names (blocks.5.q.weight stays blocks.5.q.weight: a checkpoint
loads under any layout) and its forward(x, chunk=k) runs the k-th stage
the rank holds. torch's schedule drives one PipelineStage per chunk
through a ChunkCall, whose forward calls the StageChunks module itself, so
the engine's root hooks (the start of a backward at stage 2, stage 3's
passes) see every chunk's forward. Every chunk's backward is a backward
to the engine: at stage 2 each reduces all buckets (zeros for the other
chunks' parameters), stages_per_rank times what one stage per rank sends.
"""
from __future__ import annotations

from torch import nn

from zero.parallel._stage_info import StageInfo

# torch's schedules that take several stages a rank placed by loop
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "looped-bfs")


def _multi_stage_classes():
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleLoopedBFS
    return {"interleaved-1f1b": ScheduleInterleaved1F1B, "looped-bfs": ScheduleLoopedBFS}


def chunk_indices(rank: int, pp: int, stages_per_rank: int) -> list:
    """The stages rank `rank` holds: rank, rank + pp, ... (loop placement)."""
    return [rank + k * pp for k in range(stages_per_rank)]


def _merge(into: nn.Module, part: nn.Module):
    """Register part's children under into, by name: a child that is a
    container of layers (a ModuleDict, a stage's body) is merged into a
    fresh one of its own, so the stages' layers end up side by side under
    their names, while each stage keeps its own containers."""
    for name, child in part.named_children():
        have = into._modules.get(name)
        if have is child:
            continue  # shared by two stages (a Llama's rotary embedding)
        if isinstance(child, nn.ModuleDict) or getattr(child, "_zero_layer_holder", False):
            if have is None:
                have = type(child)()
                into.add_module(name, have)
            _merge(have, child)
        elif have is None:
            into.add_module(name, child)
        else:
            raise ValueError(f"two pipeline stages hold different modules named '{name}'")


class StageChunks(nn.Module):
    """A rank's pipeline stages as one module ([Note: stage chunks]):
    forward(x, chunk=k) runs its k-th stage (StageInfo.index of each is
    pp x k + the rank). Its _zero_pipeline tells the engine the rank's
    place on the pp dimension and every tied copy its stages hold."""

    def __init__(self, stages: list, rank: int, pp: int):
        super().__init__()
        if not stages:
            raise ValueError("no stages to hold")
        for stage in stages:
            _merge(self, stage)
        for name in ("cfg", "config"):  # what the tensor-parallel plans check sizes against
            if hasattr(stages[0], name):
                setattr(self, name, getattr(stages[0], name))
        # a plain tuple: the stages are not registered twice
        self.stages = tuple(stages)
        ties = {}
        for stage in stages:
            ties.update(stage._zero_pipeline.ties)
        self._zero_pipeline = StageInfo(rank, pp, ties, stages[0]._zero_pipeline.tied)
        self._zero_stage_indices = tuple(s._zero_pipeline.index for s in stages)

    def forward(self, x, chunk: int = 0):
        return self.stages[chunk](x)


class ChunkCall(nn.Module):
    """What torch's PipelineStage drives for one chunk: its forward calls
    the StageChunks module (the engine's root) with the chunk's number.
    The chunk's stage is registered here, so PipelineStage sees its
    parameters."""

    def __init__(self, owner: StageChunks, chunk: int):
        super().__init__()
        self.stage = owner.stages[chunk]
        self.chunk = chunk
        self.__dict__["_owner"] = owner  # not registered: the engine's module

    def forward(self, x):
        return self._owner(x, chunk=self.chunk)


def split_into_chunks(make_stage, model, pp_mesh, stages_per_rank: int) -> StageChunks:
    """This rank's stages_per_rank stages of `model` over pp_mesh, each made
    by make_stage(model, index, count), held by one StageChunks."""
    if not isinstance(stages_per_rank, int) or isinstance(stages_per_rank, bool) or \
            stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be a positive integer, got {stages_per_rank!r}")
    rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
    if pp < 2:
        raise ValueError(f"stages_per_rank={stages_per_rank} needs a pp dimension of at least 2 "
                         f"ranks (it has {pp}): the interleaved schedules place stage i on "
                         "rank i mod pp")
    count = pp * stages_per_rank
    stages = [make_stage(model, index, count) for index in chunk_indices(rank, pp,
                                                                           stages_per_rank)]
    return StageChunks(stages, rank, pp)


def multi_stage_schedule(engine, pp_mesh, n_microbatches, loss_fn, schedule):
    """torch's multi-stage schedule over the engine's StageChunks: one
    PipelineStage per chunk."""
    from torch.distributed.pipelining import PipelineStage
    if isinstance(schedule, str):
        if schedule not in MULTI_STAGE_SCHEDULES:
            raise ValueError(f"the engine's model holds {len(engine.module.stages)} stages a "
                             f"rank (split with stages_per_rank > 1): schedule must be one of "
                             f"{MULTI_STAGE_SCHEDULES} or a multi-stage schedule class, got "
                             f"{schedule!r}")
        schedule = _multi_stage_classes()[schedule]
    chunks = engine.module
    count = pp_mesh.size() * len(chunks.stages)
    stages = [PipelineStage(ChunkCall(chunks, k), index, count, engine.device,
                            group=pp_mesh.get_group())
              for k, index in enumerate(chunks._zero_stage_indices)]
    built = schedule(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    _check_composes(built, engine, pp_mesh.get_local_rank(), chunks._zero_stage_indices)
    return built


def _check_composes(built, engine, rank, indices):
    """Refuse a schedule that places a rank's stages otherwise than by loop
    (the V placement of the ZBV and DualPipeV schedules), or that splits
    each backward into an input part and a later weight part (the zero-
    bubble schedules) when the engine moves gradients as a backward ends:
    stages 2-3 would reduce buckets before the weight part made them
    (measured: silently wrong parameters). Stages 0-1 keep gradients in
    .grad until the step, and compose."""
    order = getattr(built, "pipeline_order", None) or {}
    actions = [a for a in order.get(rank, ()) if a is not None]
    placed = {a.stage_index for a in actions}
    name = type(built).__name__
    if placed and not placed <= set(indices):
        raise ValueError(f"{name} places stages {sorted(placed)} on pp rank {rank}, but the "
                         f"model was split by loop placement (stages {list(indices)}); use "
                         f"one of {MULTI_STAGE_SCHEDULES}")
    if engine.stage >= 2 and any(str(getattr(a.computation_type, "value", "")) == "W"
                                 for a in actions):
        raise ValueError(f"{name} computes each backward's weight gradients after its input "
                         f"gradients (a zero-bubble schedule); ZeRO stage {engine.stage} "
                         "reduces the gradients as a backward ends, before them. Use it at "
                         f"ZeRO stage 0 or 1, or one of {MULTI_STAGE_SCHEDULES}")


def is_chunked(module) -> bool:
    return isinstance(module, StageChunks)

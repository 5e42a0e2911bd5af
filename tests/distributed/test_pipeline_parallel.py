"""Pipeline parallelism composed with ZeRO, on 4 gloo ranks: examples/gpt.py's
GPT (its head tied to the embedding) cut into stages by zero.parallel.split_gpt,
each stage trained by zero.initialize(mesh=...) over its data-parallel ranks,
micro-batches streamed by torch's schedules through zero.parallel.
pipeline_schedule, on

- pp=2 x dp=2 at ZeRO stages 0-3 (1F1B), GPipe with gradient clipping at
  stage 2, AdamW at stage 2, bf16 at stage 1, fp16 (loss scaled) at stage 2;
- pp=2 x tp=2 at stages 1 and 3 (each stage split by parallelize_gpt);
- a tiny HuggingFace Llama with a tied head, split by split_llama, pp=2 x
  dp=2 at stage 2;
- sequence parallelism and the vocabulary-parallel loss on pp=2 x tp=2
  (GPT at stage 2, Llama at stage 3), with the split layouts checked;
- two stages a rank (split_gpt(stages_per_rank=2)) under torch's
  interleaved 1F1B at stages 0-3, looped BFS with clipping, interleaved
  with tp, sequence and loss parallelism (GPT, and a 4-layer Llama), and
  the interleaved zero-bubble schedule at stage 1 (refused at stage 2);
- optimizer states in files (offload_optimizer nvme) at stage 2, and
  parameters and states in files at stage 3;

each against one process of plain torch on the same global batch: the
losses and every stage's parameters (the last stage's copy of the tied head
too) within 1e-5 (parallel_cases: SGD, and Adam at ADAM_TOL), the clip
norm within 1e-6. Then checkpoints: one saved on pp=2 x dp=2 consolidates
into the whole model (the tied head once), loads on 4 plain data-parallel
ranks, on pp=4 at stage 3 and on pp=2 x tp=2 at stage 0; one saved by the
plain ranks loads back on pp=2 x dp=2, and on two stages a rank, which
saves it again and consolidates to the same. Each holds exactly the saved
values.
All three at once (pp x tp x dp on 8 ranks): test_three_dimensions.py."""
import os

import pytest
import torch

import harness
from conftest import max_rel_error
from parallel_cases import (ADAM_TOL, BATCH, CFG, STEPS, TOL, batch, dp_place, make_model,
                            make_optimizer, mesh_of, parameter_error_ok, reference,
                            watch_layouts)


def stage_engine(mesh, stage, kind="gpt", opt="sgd", tp_options=None, watch=None,
                 stages_per_rank=1, **options):
    """This rank's stage of make_model(kind), split over mesh["pp"] (and
    mesh["tp"] where the mesh has it, with the plan's `tp_options`), in an
    engine over the rest. watch: a dict that gets the output layouts of the
    stage's first block and its head (parallel_cases.watch_layouts).
    stages_per_rank > 1: the rank's stages for an interleaved schedule."""
    import zero
    model = make_model(kind)
    llama = kind.startswith("llama")
    part = (zero.parallel.split_llama if llama else zero.parallel.split_gpt)(
        model, mesh["pp"], stages_per_rank=stages_per_rank)
    if "tp" in mesh.mesh_dim_names:
        (zero.parallel.parallelize_llama if llama else zero.parallel.parallelize_gpt)(
            part, mesh["tp"], **(tp_options or {}))
    if watch is not None:
        first = next(name for name, _ in part.named_modules()
                     if name.count(".") == 1 and name.split(".")[0] in ("blocks", "layers")
                     or name.startswith("model.layers.") and name.count(".") == 2)
        watch.update(first=first)
        seen = watch_layouts(part, (first, "head", "lm_head"))
        watch["seen"] = seen
    return zero.initialize(part, optimizer=make_optimizer(opt, part), stage=stage, mesh=mesh,
                           **options)


def run_batches(engine, mesh, kind, steps, schedule="1f1b", clip=None, micro_batches=2):
    """`steps` batches through the pipeline: (mean losses, clip norms)."""
    import torch.distributed as dist
    import zero
    llama = kind.startswith("llama")
    loss_fn = zero.parallel.causal_lm_loss if llama else zero.parallel.gpt_loss
    pipe = zero.parallel.pipeline_schedule(engine, mesh["pp"], micro_batches, loss_fn, schedule)
    pp = mesh["pp"]
    first, last = pp.get_local_rank() == 0, pp.get_local_rank() == pp.size() - 1
    index, size = dp_place(mesh)
    losses, norms = [], []
    for step in range(steps):
        ids, labels = batch(step)
        ids, labels = ids.chunk(size)[index], labels.chunk(size)[index]
        out = []
        if first:
            pipe.step(ids)
        elif last:  # a HuggingFace model's labels are its inputs (shifted in the loss)
            pipe.step(target=ids if llama else labels, losses=out)
        else:
            pipe.step()
        if clip is not None:
            norms.append(engine.clip_grad_norm_(clip))
        engine.step()
        total = torch.tensor([float(sum(x.item() for x in out))])
        dist.all_reduce(total)
        # every last-stage rank (one per data- and tensor-parallel place)
        losses.append(total.item() / (dist.get_world_size() // pp.size()))
    return losses, norms


def train(mesh, stage, kind="gpt", schedule="1f1b", clip=None, opt="sgd", precision="fp32",
          tp_options=None, watch=None, stages_per_rank=1, **options):
    engine = stage_engine(mesh, stage, kind, opt, tp_options, watch, stages_per_rank,
                          precision=precision, **options)
    losses, norms = run_batches(engine, mesh, kind, STEPS, schedule, clip)
    state = engine.full_state_dict()  # this stage's entries
    engine.close()
    return losses, norms, state


def saved_and_loaded_plain(mesh, directory, tag, save_plain=None) -> dict:
    """Train a GPT split over `mesh` two batches at stage 2 and save it
    under `tag`: its stage's entries ("stage"), the consolidated model, and
    what an engine on every rank without a mesh holds after loading it
    ("plain"; saved again under `save_plain`)."""
    import zero
    out = {}
    engine = stage_engine(mesh, 2)
    run_batches(engine, mesh, "gpt", 2)
    engine.save_checkpoint(directory, tag=tag)
    out["stage"] = engine.full_state_dict()
    engine.close()
    out["consolidated"] = zero.checkpoint.consolidate(directory, tag=tag)["model"]
    model = make_model()
    plain = zero.initialize(model, optimizer=make_optimizer("sgd", model), stage=1)
    plain.load_checkpoint(directory, tag=tag)
    out["plain"] = plain.full_state_dict()
    if save_plain is not None:
        plain.save_checkpoint(directory, tag=save_plain)
    plain.close()
    return out


def checkpoints(directory):
    out = saved_and_loaded_plain(mesh_of((2, 2), ("pp", "dp_shard")), directory, "pp",
                                 save_plain="plain")
    for label, layout, stage, tag in (("pp4 stage3", ((4,), ("pp",)), 3, "pp"),
                                      ("pp2 x tp2 stage0", ((2, 2), ("pp", "tp")), 0, "pp"),
                                      ("plain to pp2 x dp2", ((2, 2), ("pp", "dp_shard")), 1,
                                       "plain"),
                                      ("interleaved pp2 x dp2", ((2, 2), ("pp", "dp_shard")),
                                       3, "pp")):
        engine = stage_engine(mesh_of(*layout), stage,
                              stages_per_rank=2 if label.startswith("interleaved") else 1)
        engine.load_checkpoint(directory, tag=tag)
        out[label] = engine.full_state_dict()
        if label.startswith("interleaved"):  # saved again from two stages a rank
            engine.save_checkpoint(directory, tag="interleaved")
        engine.close()
    import zero
    out["interleaved consolidated"] = zero.checkpoint.consolidate(directory,
                                                                  tag="interleaved")["model"]
    # the optimizer's states, numbered in the model's order whatever the
    # layout saved them ([Note: the whole model's order] in
    # checkpoint/_stage_parts.py): loaded on two stages a rank and saved
    # again, the same states under the same numbers as saved on one
    out["optimizers"] = [zero.checkpoint.consolidate(directory, tag=tag)["optimizer"]
                         for tag in ("pp", "interleaved")]
    return out


def odd_sequence_refused(mesh):
    """What every stage's schedule says when the first stage is given a
    sequence length tp does not divide under sequence parallelism (no
    stage left waiting), and what the first stage says called alone."""
    import zero
    engine = stage_engine(mesh, 1, tp_options={"sequence_parallel": True})
    pipe = zero.parallel.pipeline_schedule(engine, mesh["pp"], 2, zero.parallel.gpt_loss)
    first = mesh["pp"].get_local_rank() == 0
    ids = torch.zeros(4, CFG.seq - 1, dtype=torch.long)
    out = {}
    try:
        pipe.step(ids) if first else pipe.step(target=ids, losses=[])
        out["schedule"] = "accepted"
    except ValueError as e:
        out["schedule"] = str(e)
    if first:
        try:
            engine.module(ids)
            out["alone"] = "accepted"
        except ValueError as e:
            out["alone"] = str(e)
    engine.close()
    return out


def short_batch_refused(mesh):
    """What each stage says when a batch after the first is shorter (an
    epoch's last batch): torch's stages keep their first step's shapes, and
    a shorter one made the receiving rank abort in gloo."""
    import zero
    engine = stage_engine(mesh, 1)
    pipe = zero.parallel.pipeline_schedule(engine, mesh["pp"], 2, zero.parallel.gpt_loss)
    first = mesh["pp"].get_local_rank() == 0
    out = []
    for size in (BATCH, BATCH - 2):
        ids = batch(0)[0][:size]
        try:
            pipe.step(ids) if first else pipe.step(target=ids, losses=[])
            engine.step()
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    engine.close()
    return out


def zero_bubble(mesh):
    """torch's interleaved zero-bubble schedule: trained at ZeRO stage 1;
    refused at stage 2, which reduces gradients as a backward ends, before
    its weight part."""
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
    out = {"stage 1": train(mesh, 1, schedule=ScheduleInterleavedZeroBubble,
                            stages_per_rank=2)}
    engine = stage_engine(mesh, 2, stages_per_rank=2)
    try:
        run_batches(engine, mesh, "gpt", 1, ScheduleInterleavedZeroBubble)
        out["stage 2"] = "accepted"
    except ValueError as e:
        out["stage 2"] = str(e)
    engine.close()
    return out


def _worker(rank, world, directory):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    pp_dp = mesh_of((2, 2), ("pp", "dp_shard"))
    pp_tp = mesh_of((2, 2), ("pp", "tp"))
    out = {}
    for stage in (0, 1, 2, 3):
        out[("pp2 x dp2", stage)] = train(pp_dp, stage)
    out["gpipe + clip"] = train(pp_dp, 2, schedule="gpipe", clip=0.5)
    out["adamw"] = train(pp_dp, 2, opt="adamw")
    out["bf16"] = train(pp_dp, 1, precision="bf16")
    import zero
    # a fixed scale: every step applied (a dynamic one skips the first)
    out["fp16"] = train(pp_dp, 2, precision="fp16",
                        loss_scaling=zero.LossScaling(static_loss_scale=1024.0))
    for stage in (1, 3):
        out[("pp2 x tp2", stage)] = train(pp_tp, stage)
    out["llama tied"] = train(pp_dp, 2, kind="llama tied")
    both = {"sequence_parallel": True, "loss_parallel": True}
    watch = out["sequence + loss parallel layouts"] = {}
    out["sequence + loss parallel"] = train(pp_tp, 2, tp_options=both, watch=watch)
    out["llama sequence + loss parallel"] = train(pp_tp, 3, kind="llama tied", tp_options=both)
    out["odd sequence"] = odd_sequence_refused(pp_tp)
    out["short batch"] = short_batch_refused(pp_dp)
    for stage in (0, 1, 2, 3):  # two stages a rank, one block each
        out[("interleaved", stage)] = train(pp_dp, stage, schedule="interleaved-1f1b",
                                            stages_per_rank=2)
    out["looped bfs"] = train(pp_dp, 2, schedule="looped-bfs", stages_per_rank=2, clip=0.5)
    out["interleaved pp2 x tp2"] = train(pp_tp, 3, schedule="interleaved-1f1b",
                                         stages_per_rank=2, tp_options=both)
    out["interleaved llama pp2 x tp2"] = train(pp_tp, 2, kind="llama tied, 4 layers",
                                               schedule="interleaved-1f1b", stages_per_rank=2,
                                               tp_options=both)
    out["zero bubble"] = zero_bubble(pp_dp)
    # offload to files (on a CPU model, "cpu" is where the states already are)
    files = {"device": "nvme", "nvme_path": os.path.join(directory, f"nvme{rank}")}
    os.makedirs(files["nvme_path"])
    out["offload"] = train(pp_dp, 2, offload_optimizer=files)
    out["offload params"] = train(pp_dp, 3, offload_optimizer=files, offload_param=files)
    out["checkpoints"] = checkpoints(directory)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pp_checkpoints"))
    return harness.run(4, _worker, directory, timeout=600)


def check_run(run, kind="gpt", clip=None, opt="sgd", tol=TOL):
    """A rank's run against one process of torch: the losses, its stage's
    parameters (a tied copy against the parameter it copies), the norms."""
    losses, norms, state = run
    ref_losses, ref_norms, ref_state = reference(clip=clip, opt=opt, kind=kind)
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < tol
    assert state
    for name, value in state.items():
        assert parameter_error_ok(value, ref_state[name], opt, tol), name
    if clip is not None:
        assert norms and all(n > clip for n in norms)  # the clip bites
        assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) < 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pp2_dp2_matches_one_process(results, stage):
    for rank_out in results:
        check_run(rank_out[("pp2 x dp2", stage)])


def test_gpipe_with_clipping(results):
    for rank_out in results:
        check_run(rank_out["gpipe + clip"], clip=0.5)


def test_adamw(results):
    for rank_out in results:
        check_run(rank_out["adamw"], opt="adamw", tol=ADAM_TOL)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_tracks_fp32(results, precision):
    """bf16 keeps 8 bits of mantissa, fp16 11: the losses within a few of
    bf16's ulps. fp16's losses come back divided by the loss scale the
    schedule's backwards were multiplied by."""
    ref_losses, _norms, ref_state = reference()
    for rank_out in results:
        losses, _norms, state = rank_out[precision]
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 2e-2
        # the fp32 masters took the updates (the parameters move by up to
        # their whole size over these steps; a scale left in would show)
        assert max(max_rel_error(v, ref_state[k]) for k, v in state.items()) < 2e-2


@pytest.mark.parametrize("stage", [1, 3])
def test_pp2_tp2(results, stage):
    for rank_out in results:
        check_run(rank_out[("pp2 x tp2", stage)])


def test_hf_llama_with_a_tied_head(results):
    for rank_out in results:
        check_run(rank_out["llama tied"], kind="llama tied")
    # the last stage's head is a copy of the first stage's embedding
    assert "lm_head.weight" in results[3]["llama tied"][2]
    assert "model.embed_tokens.weight" in results[0]["llama tied"][2]


def test_sequence_and_loss_parallel_under_pp(results):
    """pp2 x tp2 with the plan's sequence parallelism (the stages send
    sequence shards) and its vocabulary-parallel loss (the schedule's loss
    runs under torch's loss_parallel()): one process's losses and
    parameters; the layouts are the split ones."""
    for rank_out in results:
        check_run(rank_out["sequence + loss parallel"])
        check_run(rank_out["llama sequence + loss parallel"], kind="llama tied")
    micro = BATCH // 2  # two micro-batches, no data parallelism
    for rank in (0, 1, 2, 3):  # pp index rank // 2
        watch = results[rank]["sequence + loss parallel layouts"]
        assert watch["seen"][watch["first"]] == (("S(1)",), (micro, CFG.seq // 2, CFG.dim))
    for rank in (2, 3):
        seen = results[rank]["sequence + loss parallel layouts"]["seen"]
        assert seen["head"] == (("S(2)",), (micro, CFG.seq, CFG.vocab // 2))
    message = "sequence length 7 is not divisible by the tp size (2)"
    for rank in (0, 1, 2, 3):
        assert message in results[rank]["odd sequence"]["schedule"]
    for rank in (0, 1):
        assert message in results[rank]["odd sequence"]["alone"]


def test_a_shorter_batch_is_refused_on_the_stages_that_hold_it(results):
    size = (BATCH - 2) // 2
    for rank, held in ((0, "args[0]"), (1, "args[0]"), (2, "target="), (3, "target=")):
        first, second = results[rank]["short batch"]
        assert first == "accepted"
        assert second.startswith(f"pipeline schedule step: {held} gives micro-batches of "
                                 f"shape ({size}, {CFG.seq}), the first step's were "
                                 f"({BATCH // 2}, {CFG.seq})"), second


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_interleaved_1f1b(results, stage):
    """Two stages a rank (stages r and r + 2 of 4, one block each), torch's
    interleaved 1F1B: one process's losses and parameters."""
    for rank_out in results:
        check_run(rank_out[("interleaved", stage)])
        assert sum(name.endswith("q.weight") for name in rank_out[("interleaved", stage)][2]) \
            == 2


def test_looped_bfs_and_interleaved_3d_pieces(results):
    for rank_out in results:
        check_run(rank_out["looped bfs"], clip=0.5)
        check_run(rank_out["interleaved pp2 x tp2"])
        check_run(rank_out["interleaved llama pp2 x tp2"], kind="llama tied, 4 layers")


def test_zero_bubble_composes_at_stage_1_only(results):
    for rank_out in results:
        check_run(rank_out["zero bubble"]["stage 1"])
        assert "ZeRO stage 2 reduces the gradients as a backward ends" in \
            rank_out["zero bubble"]["stage 2"]


def test_offload_to_files_under_pp(results):
    for rank_out in results:
        check_run(rank_out["offload"])
        check_run(rank_out["offload params"])


def test_checkpoints_load_under_other_layouts(results):
    whole = results[0]["checkpoints"]["consolidated"]
    assert set(whole) == set(make_model().state_dict())
    assert torch.equal(whole["head.weight"], whole["embed.weight"])
    for rank_out in results:
        out = rank_out["checkpoints"]
        assert torch.equal(out["consolidated"]["blocks.3.q.weight"], whole["blocks.3.q.weight"])
        for label in ("stage", "plain", "pp4 stage3", "pp2 x tp2 stage0", "plain to pp2 x dp2",
                      "interleaved pp2 x dp2"):
            for name, value in out[label].items():
                assert torch.equal(value, whole[name]), (label, name)
        assert set(out["plain"]) == set(whole)
        assert set(out["interleaved consolidated"]) == set(whole)
        for name, value in out["interleaved consolidated"].items():
            assert torch.equal(value, whole[name]), name
        one, two = out["optimizers"]
        assert one["param_groups"] == two["param_groups"]
        assert sorted(one["state"]) == sorted(two["state"]) and len(one["state"]) > 8
        for index, states in one["state"].items():
            assert states.keys() == two["state"][index].keys()
            for key, value in states.items():
                assert torch.equal(value, two["state"][index][key]), (index, key)

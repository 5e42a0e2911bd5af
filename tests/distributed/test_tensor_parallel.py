"""Tensor parallelism composed with ZeRO, on 4 gloo ranks: examples/gpt.py's
GPT split over the mesh's `tp` dimension by zero.parallel.parallelize_gpt
(torch's parallelize_module: heads and MLP column/row-wise, vocabulary-
parallel embedding and tied head), trained by zero.initialize(mesh=...) on

- tp=2 x dp_shard=2 at stages 0-3 (fp32, AdamW), with gradient clipping and
  accumulation at stage 2, and bf16 at stage 2;
- dp_replicate=2 x tp=2 at stage 3 (hybrid: the partitions are whole, two
  replicas), and tp=4 alone at stage 1;
- a tiny HuggingFace Llama (grouped-query attention) split by
  zero.parallel.parallelize_llama, tp=2 x dp=2 at stage 2;
- Megatron's sequence parallelism (parallelize_gpt/_llama(sequence_
  parallel=True)): GPT at stage 2, GPT with the vocabulary-parallel loss,
  AdamW, accumulation and clipping at stage 3, Llama at stage 1, GPT-2
  with the vocabulary-parallel loss at stage 3, with the residual stream
  checked to be split by sequence;
- a tiny HuggingFace GPT-2 (Conv1D layers, q, k and v packed in c_attn,
  a tied head) split by zero.parallel.parallelize_gpt2, tp=2 x dp=2 at
  stage 3, and its checkpoint loaded by 4 plain data-parallel ranks
  (c_attn's strided pieces put back whole);

each against one process of plain torch on the same global batch: losses
and final parameters within 1e-5 (normwise, conftest.max_rel_error; the
gradients are summed in another order than one process sums them, a few
ulps a step; AdamW's as parallel_cases.parameter_error_ok says), and
clip_grad_norm_'s norm against torch's. The key biases
are frozen: their exact gradient is zero (softmax ignores a constant added
to a query's scores), so what one computes is rounding noise, which Adam
turns into steps of size lr, different in every order of summation.

Then checkpoints: one saved on tp=2 x dp=2 at stage 3 loads on tp=4 at
stage 1, on 4 plain data-parallel ranks at stage 2 (no tp), and one saved
there loads back on tp=2 x dp=2 at stage 0, each holding exactly the saved
values; consolidate gives the whole tensors. close() hands back DTensor
parameters holding the trained values, and each run's memory_summary()
equals zero.estimate_memory of the parallelized model on the mesh."""
import os

import pytest
import torch

import harness
from parallel_cases import (ADAM_TOL, BATCH, CFG, STEPS, TOL, batch, dp_place, loss_of,
                            make_model, make_optimizer, mesh_of, parameter_error_ok,
                            reference, watch_layouts)
from test_estimate import check as check_estimate


def parallelized(kind, mesh, loss_parallel=False, sequence_parallel=False):
    """make_model(kind), split over the mesh's tp dimension by zero's plan."""
    import zero
    model = make_model(kind)
    if "tp" in mesh.mesh_dim_names:
        parallelize = {"llama": zero.parallel.parallelize_llama,
                       "gpt2": zero.parallel.parallelize_gpt2}.get(kind,
                                                                   zero.parallel.parallelize_gpt)
        extra = {"sequence_parallel": True} if sequence_parallel else {}
        parallelize(model, mesh["tp"], loss_parallel=loss_parallel, **extra)
    return model


def _engine(mesh, stage, opt="sgd", kind="gpt", **options):
    import zero
    model = parallelized(kind, mesh)
    return zero.initialize(model, optimizer=make_optimizer(opt, model), stage=stage,
                           mesh=mesh, **options)


# the residual stream after the first block, and the logits
WATCHED = ("blocks.0", "model.layers.0", "transformer.h.0", "head", "lm_head")


def train(mesh, stage, accumulation=1, clip=None, precision="fp32", opt="sgd", kind="gpt",
          loss_parallel=False, sequence_parallel=False, **options):
    """(losses, clip norms, full_state_dict, the model's DTensor check,
    (memory_summary, estimate_memory), the WATCHED modules' output layouts).
    loss_parallel: the head's logits stay split by vocabulary, and each
    micro-batch's loss and backward run inside torch's loss_parallel().
    sequence_parallel: the plan's sequence parallelism."""
    import contextlib

    import torch.distributed as dist

    import zero
    model = parallelized(kind, mesh, loss_parallel, sequence_parallel)
    seen = watch_layouts(model, WATCHED)
    engine = zero.initialize(model, optimizer=make_optimizer(opt, model), stage=stage,
                             mesh=mesh, gradient_accumulation_steps=accumulation,
                             precision=precision, **options)
    tp = mesh["tp"] if "tp" in mesh.mesh_dim_names else None  # DeepSpeed's layout queries
    assert engine.mp_world_size == (tp.size() if tp is not None else 1)
    assert engine.get_model_parallel_rank() == (tp.get_local_rank() if tp is not None else 0)
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as context
    else:
        context = contextlib.nullcontext
    index, size = dp_place(mesh)
    losses, norms = [], []
    for step in range(STEPS):
        ids, labels = batch(step)
        ids, labels = ids.chunk(size)[index], labels.chunk(size)[index]
        total = torch.zeros(1)
        for ids_m, labels_m in zip(ids.chunk(accumulation), labels.chunk(accumulation)):
            with context():
                loss = loss_of(engine, ids_m, labels_m)
                engine.backward(loss)
            if loss_parallel:  # a replicated DTensor
                loss = loss.to_local()
            total += loss.detach().float() / accumulation
            if clip is not None and engine.is_accumulation_boundary:
                norms.append(engine.clip_grad_norm_(clip))
            engine.step()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    state = engine.full_state_dict()
    memory = _memory_pair(engine, mesh, stage, opt, kind, precision, options)
    model = engine.module
    engine.close()
    # close() hands back DTensor parameters holding the trained values (in
    # the compute dtype's rounding, in the model's own dtype: [Note: dtypes
    # given back] in engine/_handback.py)
    handed = True
    if "tp" in mesh.mesh_dim_names:
        from torch.distributed.tensor import DTensor
        name, p = next((n, p) for n, p in model.named_parameters() if n.endswith("q.weight") or
                       n.endswith("q_proj.weight") or n.endswith("c_attn.weight"))
        rounded = state[name].to(torch.bfloat16 if precision == "bf16" else torch.float32)
        handed = isinstance(p, DTensor) and p.dtype == torch.float32 and torch.equal(
            p.full_tensor(), rounded.float())
        if kind == "gpt":
            handed = handed and model.head.weight is model.embed.weight
    return losses, norms, state, handed, memory, seen


def _memory_pair(engine, mesh, stage, opt, kind, precision, options):
    """(what the engine holds, zero.estimate_memory of a fresh copy of the
    parallelized model on the mesh): a rank's local pieces."""
    import zero
    fresh = parallelized(kind, mesh)
    estimate = zero.estimate_memory(fresh, mesh=mesh, stage=stage, precision=precision,
                                    optimizer=make_optimizer(opt, fresh), **options)
    return dict(engine.memory_summary()), dict(estimate)


def checkpoints(directory):
    """Save on tp=2 x dp=2 at stage 3, load elsewhere; what each holds."""
    import zero
    out = {}
    mesh = mesh_of((2, 2), ("dp_shard", "tp"))
    engine = _engine(mesh, 3)
    for step in range(2):
        ids, labels = batch(step)
        index, size = dp_place(mesh)
        engine.backward(engine(ids.chunk(size)[index], labels.chunk(size)[index]))
        engine.step()
    engine.save_checkpoint(directory, tag="tp")
    out["saved"] = engine.full_state_dict()
    engine.close()
    out["consolidated"] = zero.checkpoint.consolidate(directory, tag="tp")["model"]
    for label, layout, stage in (("tp4 stage1", ((4,), ("tp",)), 1),
                                 ("dp4 stage2", ((4,), ("dp_shard",)), 2)):
        engine = _engine(mesh_of(*layout), stage)
        engine.load_checkpoint(directory, tag="tp")
        out[label] = engine.full_state_dict()
        if label.startswith("dp4"):
            engine.save_checkpoint(directory, tag="plain")
        engine.close()
    engine = _engine(mesh, 0)
    engine.load_checkpoint(directory, tag="plain")
    out["plain to tp2 x dp2 stage0"] = engine.full_state_dict()
    engine.close()
    return out


def gpt2_checkpoint(directory):
    """GPT-2 saved on tp=2 x dp=2 at stage 1, loaded by 4 plain ranks."""
    mesh = mesh_of((2, 2), ("dp_shard", "tp"))
    engine = _engine(mesh, 1, kind="gpt2")
    index, size = dp_place(mesh)
    ids, labels = batch(0)
    engine.backward(loss_of(engine, ids.chunk(size)[index], labels.chunk(size)[index]))
    engine.step()
    engine.save_checkpoint(directory, tag="gpt2")
    saved = engine.full_state_dict()
    engine.close()
    engine = _engine(mesh_of((4,), ("dp_shard",)), 2, kind="gpt2")
    engine.load_checkpoint(directory, tag="gpt2")
    loaded = engine.full_state_dict()
    engine.close()
    return saved, loaded


def _worker(rank, world, directory):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    tp2_dp2 = mesh_of((2, 2), ("dp_shard", "tp"))
    out = {}
    for stage in (0, 1, 2, 3):
        out[("tp2 x dp2", stage)] = train(tp2_dp2, stage)
    out["adamw"] = train(tp2_dp2, 3, opt="adamw")
    out["clip + accumulation"] = train(tp2_dp2, 2, accumulation=2, clip=0.5)
    out["bf16"] = train(tp2_dp2, 2, precision="bf16")
    out["replicas x tp2"] = train(mesh_of((2, 1, 2), ("dp_replicate", "dp_shard", "tp")), 3)
    out["tp4"] = train(mesh_of((4,), ("tp",)), 1)
    out["llama"] = train(tp2_dp2, 2, kind="llama")
    out["gpt2"] = train(tp2_dp2, 3, kind="gpt2")
    out["loss parallel"] = train(tp2_dp2, 2, loss_parallel=True)
    out["llama loss parallel"] = train(tp2_dp2, 1, kind="llama", loss_parallel=True)
    out["sequence parallel"] = train(tp2_dp2, 2, sequence_parallel=True)
    out["sequence + loss parallel"] = train(tp2_dp2, 3, opt="adamw", sequence_parallel=True,
                                            loss_parallel=True, accumulation=2, clip=0.5)
    out["llama sequence parallel"] = train(tp2_dp2, 1, kind="llama", sequence_parallel=True)
    out["gpt2 sequence + loss parallel"] = train(tp2_dp2, 3, kind="gpt2",
                                                 sequence_parallel=True, loss_parallel=True)
    # on a CPU model, "cpu" is where the states already are: files are the real offload
    files = {"device": "nvme", "nvme_path": os.path.join(directory, f"nvme{rank}")}
    os.makedirs(files["nvme_path"])
    out["offload"] = train(tp2_dp2, 2, offload_optimizer=files)
    out["offload params"] = train(tp2_dp2, 3, offload_optimizer=files, offload_param=files)
    out["gpt2 checkpoint"] = gpt2_checkpoint(directory)
    out["checkpoints"] = checkpoints(directory)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tp_checkpoints"))
    return harness.run(4, _worker, directory, timeout=600)


def _check_run(run, accumulation=1, clip=None, tol=TOL, opt="sgd", kind="gpt"):
    losses, norms, state, handed, (measured, estimated), _seen = run
    check_estimate(estimated, measured)
    ref_losses, ref_norms, ref_state = reference(accumulation, clip, opt, kind)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < tol
    for name, ref in ref_state.items():
        assert parameter_error_ok(state[name], ref, opt, tol), name
    if clip is not None:
        # a sum of squares in float64: the norm to a few fp32 ulps
        assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) < 1e-6
    assert handed


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tp2_dp2_matches_one_process(results, stage):
    for rank_out in results:  # every rank holds the whole model
        _check_run(rank_out[("tp2 x dp2", stage)])


def test_adamw(results):
    _check_run(results[0]["adamw"], tol=ADAM_TOL, opt="adamw")


def test_clipping_and_accumulation(results):
    run = results[0]["clip + accumulation"]
    assert run[1] and all(n > 0.5 for n in run[1])  # the clip bites
    _check_run(run, accumulation=2, clip=0.5)


def test_bf16_tracks_fp32(results):
    losses, _norms, _state, handed, (measured, estimated), _seen = results[0]["bf16"]
    check_estimate(estimated, measured)
    ref_losses = reference()[0]
    # bf16 keeps 8 bits of mantissa: the loss within a few of its ulps
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 2e-2
    assert handed


def test_replicas_and_tp_alone(results):
    _check_run(results[0]["replicas x tp2"])
    _check_run(results[3]["tp4"])


def test_hf_llama(results):
    _check_run(results[1]["llama"], kind="llama")


def test_hf_gpt2(results):
    _check_run(results[2]["gpt2"], kind="gpt2")
    saved, loaded = results[0]["gpt2 checkpoint"]
    assert set(saved) == set(loaded)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    assert saved["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)


def test_loss_parallel(results):
    """The logits never gathered: torch's vocabulary-parallel cross entropy."""
    _check_run(results[0]["loss parallel"])
    _check_run(results[1]["llama loss parallel"], kind="llama")


def test_sequence_parallel(results):
    """Megatron's sequence parallelism: the residual stream between blocks
    is split by sequence over tp (each tp rank holds T/2 of the tokens, a
    DTensor of the whole shape), with the losses and parameters of one
    process; with the vocabulary-parallel loss the logits stay split."""
    half_batch = BATCH // 2  # dp_shard=2
    _check_run(results[0]["sequence parallel"])
    _check_run(results[1]["sequence + loss parallel"], accumulation=2, clip=0.5, tol=ADAM_TOL,
               opt="adamw")
    _check_run(results[2]["llama sequence parallel"], kind="llama")
    split = (("S(1)",), (half_batch, CFG.seq // 2, CFG.dim))
    assert results[0]["sequence parallel"][5]["blocks.0"] == split
    assert results[0]["sequence parallel"][5]["head"] == ("plain", (half_batch, CFG.seq,
                                                                    CFG.vocab))
    assert results[2]["llama sequence parallel"][5]["model.layers.0"] == split
    gpt2 = results[3]["gpt2 sequence + loss parallel"]
    _check_run(gpt2, kind="gpt2")
    assert gpt2[5]["transformer.h.0"] == split
    assert gpt2[5]["lm_head"] == (("S(2)",), (half_batch, CFG.seq, CFG.vocab // 2))
    seen = results[1]["sequence + loss parallel"][5]
    assert seen["blocks.0"] == (("S(1)",), (half_batch // 2, CFG.seq // 2, CFG.dim))
    assert seen["head"] == (("S(2)",), (half_batch // 2, CFG.seq, CFG.vocab // 2))
    # the plain plan keeps the residual stream whole on every tp rank
    assert results[0][("tp2 x dp2", 2)][5]["blocks.0"] == ("plain", (half_batch, CFG.seq,
                                                                     CFG.dim))


def test_offload_to_files_under_tp(results):
    _check_run(results[3]["offload"])
    _check_run(results[2]["offload params"])


def test_checkpoints_load_under_other_layouts(results):
    for rank_out in results:
        out = rank_out["checkpoints"]
        saved = out["saved"]
        for label in ("consolidated", "tp4 stage1", "dp4 stage2", "plain to tp2 x dp2 stage0"):
            got = out[label]
            assert set(got) == set(saved), label
            for name, value in saved.items():
                assert torch.equal(got[name], value), (label, name)
        assert saved["embed.weight"].shape == (CFG.vocab, CFG.dim)

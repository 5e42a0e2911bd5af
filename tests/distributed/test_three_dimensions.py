"""3D parallelism on 8 gloo ranks: pp=2 x dp=2 x tp=2 on one mesh.
examples/gpt.py's GPT (head tied to the embedding) is cut into two stages
by zero.parallel.split_gpt, each stage split over tp by parallelize_gpt,
and each stage's local pieces partitioned by ZeRO over dp; torch's 1F1B
schedule streams the micro-batches. At ZeRO stages 0-3 (stage 2 with
gradient clipping) against one process of plain torch on the same global
batch: losses and every rank's parameters within 1e-5 (parallel_cases),
the clip norm within 1e-6; the same at stage 2 with the plan's sequence
parallelism and vocabulary-parallel loss. A checkpoint saved on the 3D mesh consolidates
into the whole model and loads on 8 plain data-parallel ranks and on
tp=2 x dp=4, holding exactly the saved values."""
import pytest
import torch

import harness
from conftest import max_rel_error
from parallel_cases import make_model, make_optimizer, mesh_of, reference
from test_pipeline_parallel import run_batches, saved_and_loaded_plain, stage_engine
from test_tensor_parallel import parallelized

LAYOUT = ((2, 2, 2), ("pp", "dp_shard", "tp"))


def train(stage, clip=None, tp_options=None):
    mesh = mesh_of(*LAYOUT)
    engine = stage_engine(mesh, stage, tp_options=tp_options)
    losses, norms = run_batches(engine, mesh, "gpt", 4, clip=clip)
    state = engine.full_state_dict()
    engine.close()
    return losses, norms, state


def checkpoints(directory):
    import zero
    out = saved_and_loaded_plain(mesh_of(*LAYOUT), directory, "3d")
    tp_dp = mesh_of((4, 2), ("dp_shard", "tp"))
    model = parallelized("gpt", tp_dp)
    engine = zero.initialize(model, optimizer=make_optimizer("sgd", model), stage=3, mesh=tp_dp)
    engine.load_checkpoint(directory, tag="3d")
    out["tp2 x dp4"] = engine.full_state_dict()
    engine.close()
    return out


def _worker(rank, world, directory):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    out = {stage: train(stage) for stage in (0, 1, 3)}
    out["clip"] = train(2, clip=0.5)
    out["sequence + loss parallel"] = train(
        2, clip=0.5, tp_options={"sequence_parallel": True, "loss_parallel": True})
    out["checkpoints"] = checkpoints(directory)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("3d_checkpoints"))
    return harness.run(8, _worker, directory, timeout=900)


def _check(run, clip=None):
    losses, norms, state = run
    ref_losses, ref_norms, ref_state = reference(clip=clip)
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 1e-5
    assert state
    for name, value in state.items():
        assert max_rel_error(value, ref_state[name]) < 1e-5, name
    if clip is not None:
        assert norms and all(n > clip for n in norms)
        assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) < 1e-6


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_pp_tp_dp_matches_one_process(results, stage):
    for rank_out in results:
        _check(rank_out[stage])


def test_clipping(results):
    for rank_out in results:
        _check(rank_out["clip"], clip=0.5)


def test_sequence_and_loss_parallel(results):
    for rank_out in results:
        _check(rank_out["sequence + loss parallel"], clip=0.5)


def test_checkpoint_loads_plain_and_on_another_layout(results):
    whole = results[0]["checkpoints"]["consolidated"]
    assert set(whole) == set(make_model().state_dict())
    for rank_out in results:
        out = rank_out["checkpoints"]
        for label in ("stage", "plain", "tp2 x dp4"):
            for name, value in out[label].items():
                assert torch.equal(value, whole[name]), (label, name)

"""Collectives staged through host memory ([Note: host-staged collectives]
in python/zero/comm/_host_staging.py), the path of ranks that share a GPU,
run here on gloo ranks with CPU tensors standing in for the device's: the
staging is forced on, so every collective of the engine reads host copies
and writes back only what it produced, as it does for CUDA tensors.

The engine cases train stages 0-3 against the single-process torch
reference (scenarios.py) at 1e-5 normwise in fp32, as test_engine_parity.py
and test_stage3.py do: staging copies values and adds no arithmetic. The
Comm cases check each collective's copies back exactly: what it writes
reaches the tensor (an async one's at wait(), not before), and what it does
not write is left as it was."""
import contextlib

import pytest
import torch

import harness
import scenarios
from conftest import max_rel_error

WORLDS = [2, 3]
RELEASED = dict(stage3_param_persistence_threshold=0)
CASES = {
    # name: (stage, engine options, reference options)
    "stage 0": (0, dict(clip=0.05), dict(clip=0.05)),
    "stage 1 accumulate": (1, dict(accumulation=2, opt="sgd", lr=0.1),
                           dict(accumulation=2, opt="sgd", lr=0.1)),
    "stage 2 small buckets": (2, dict(reduce_bucket_size=50, checkpointing="reentrant_all"), {}),
    "stage 2 reduce_scatter": (2, dict(clip=0.05, bucket_reduction="reduce_scatter"),
                               dict(clip=0.05)),
    "stage 2 torch step": (2, dict(clip=0.05, torch_step=True), dict(clip=0.05)),
    "stage 3 released": (3, dict(RELEASED, clip=0.05), dict(clip=0.05)),
    "stage 3 persistent": (3, {}, {}),
    "stage 3 reduce_scatter": (3, dict(RELEASED, bucket_reduction="reduce_scatter"), {}),
}
STEPS = 6


@contextlib.contextmanager
def staged():
    """Comms made inside stage every collective through host copies."""
    import torch.distributed as dist
    from zero.comm import _comm
    chosen = _comm.stages_through_host
    _comm.stages_through_host = lambda device, group=None: dist.get_world_size(group) > 1
    try:
        yield
    finally:
        _comm.stages_through_host = chosen


def _engine_cases(rank, world):
    out = {}
    for name, (stage, opts, _ref) in CASES.items():
        opts = dict(opts)
        with staged(), (scenarios.torch_step() if opts.pop("torch_step", False)
                        else contextlib.nullcontext()):
            out[name] = scenarios.engine_run(rank, world, STEPS, stage, **opts)
    # the same run unstaged stages nothing
    out["unstaged"] = scenarios.engine_run(rank, world, STEPS, 3, **RELEASED)
    out["comm"] = _comm_cases(rank, world)
    return out


def _comm_cases(rank, world):
    """Each of Comm's collectives, staged, with what it left behind."""
    from zero.comm._comm import Comm
    with staged():
        comm = Comm(torch.device("cpu"))
    assert comm.staged
    facts = {}
    t = torch.full((5,), float(rank + 1))
    comm.all_reduce_sum(t)
    facts["all_reduce"] = t.clone()
    t = torch.full((5,), float(rank + 1))
    comm.reduce_sum(t, dst=1, async_op=True).wait()
    facts["reduce"] = t.clone()  # the sum on rank 1, untouched elsewhere
    out = torch.full((2,), -1.0)
    whole = torch.arange(2.0 * world) + 100 * rank
    work = comm.reduce_scatter_sum(out, whole, async_op=True)
    facts["reduce_scatter before wait"] = out.clone()
    work.wait()
    facts["reduce_scatter"] = out.clone()
    full = torch.full((3 * world,), -1.0)
    work = comm.all_gather_into(full, torch.full((3,), float(rank)), async_op=True)
    facts["all_gather before wait"] = full.clone()
    work.wait()
    facts["all_gather"] = full.clone()
    t = torch.full((4,), float(rank))
    comm.broadcast(t, src=world - 1)
    facts["broadcast"] = t.clone()
    t = torch.tensor([float(rank), 1.0])
    comm.sum_scalars_(t)
    facts["sum_scalars"] = t.clone()
    facts["staged_bytes"] = comm.log.summary()["host_staged_bytes"]
    return facts


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def runs(request):
    world = request.param
    return world, harness.run(world, _engine_cases)


@pytest.fixture(scope="module")
def references():
    refs = {name: scenarios.reference_run(STEPS, **ref) for name, (_s, _o, ref) in CASES.items()}
    refs["unstaged"] = scenarios.reference_run(STEPS)
    return refs


@pytest.mark.parametrize("case", list(CASES) + ["unstaged"])
def test_staged_training_matches_torch(runs, references, case):
    world, results = runs
    ref_losses, ref_state = references[case]
    for rank in range(world):
        losses, state, facts = results[rank][case]
        assert max_rel_error(torch.tensor(losses), torch.tensor(ref_losses)) < 1e-5, (case, rank)
        for key, ref in ref_state.items():
            assert max_rel_error(state[key], ref) < 1e-5, (case, rank, key)
        staged_bytes = facts["comm"]["host_staged_bytes"]
        if case == "unstaged":
            assert staged_bytes == 0
        else:
            # at least this step's reduced gradients went through host copies
            assert staged_bytes > 0, case


def test_each_collective_writes_back_what_it_produced_and_nothing_else(runs):
    world, results = runs
    total = sum(range(1, world + 1))
    for rank in range(world):
        facts = results[rank]["comm"]
        assert torch.equal(facts["all_reduce"], torch.full((5,), float(total)))
        expected = total if rank == 1 else rank + 1
        assert torch.equal(facts["reduce"], torch.full((5,), float(expected)))
        # an async collective's output is written at its wait(), not before
        assert torch.equal(facts["reduce_scatter before wait"], torch.full((2,), -1.0))
        chunk = torch.arange(2.0 * rank, 2.0 * rank + 2)
        assert torch.equal(facts["reduce_scatter"],
                          world * chunk + 100 * sum(range(world)))
        assert torch.equal(facts["all_gather before wait"], torch.full((3 * world,), -1.0))
        assert torch.equal(facts["all_gather"],
                           torch.arange(float(world)).repeat_interleave(3))
        assert torch.equal(facts["broadcast"], torch.full((4,), float(world - 1)))
        assert torch.equal(facts["sum_scalars"],
                           torch.tensor([float(sum(range(world))), float(world)]))
        assert facts["staged_bytes"] > 0


def test_batches_staged_on_the_host_are_not_counted_as_gathered_memory(runs):
    """A prefetch of small units together holds (world + 1) x its chunks
    in its own buffers: on the device they count in gathered_peak, staged
    they are in host memory and do not."""
    world, results = runs
    for rank in range(world):
        staged = results[rank]["stage 3 released"][2]["memory"]["gathered_peak"]
        unstaged = results[rank]["unstaged"][2]["memory"]["gathered_peak"]
        assert 0 < staged < unstaged, (staged, unstaged)

"""Stage 3 on 1, 2 and 3 gloo ranks against the single-process torch
reference (tests/distributed/scenarios.py), with parameters released after
every use (persistence threshold 0) unless a case says otherwise.

Tolerance: as in test_engine_parity.py, max relative error (normwise) 1e-5
in fp32. Stage 3 adds no arithmetic of its own: a gather copies values, and
the gradients go through the same SUM reductions as stage 2.

The model (scenarios.Net) has tied embedding/head, a module called twice, a
frozen layer, a branch used on even steps only (so the recorded module
order changes every step and prefetch must fall back), a buffer, and odd
sizes. The cases add activation checkpointing (both torch.utils.checkpoint
modes), a no_grad forward before every step, a change made through
zero.GatheredParameters by rank 0 (the other ranks write garbage that must
not survive), a loss term taken inside zero.GatheredParameters, and
bounded prefetch, the buckets reduced by reduce_scatter, and units kept
from forward to backward (stage3_max_reuse_distance)."""
import tempfile

import pytest
import torch

import harness
import scenarios
from conftest import max_rel_error

WORLDS = [1, 2, 3]
RELEASED = dict(stage3_param_persistence_threshold=0)
CASES = {
    # name: (engine options, reference options)
    "released": (dict(RELEASED), {}),
    "persistent": (dict(), {}),
    "sgd": (dict(RELEASED, opt="sgd", lr=0.1), dict(opt="sgd", lr=0.1)),
    "accumulate": (dict(RELEASED, accumulation=2, opt="sgd", lr=0.1),
                   dict(accumulation=2, opt="sgd", lr=0.1)),
    "clip": (dict(RELEASED, clip=0.05), dict(clip=0.05)),
    "prefetch bounded": (dict(RELEASED, stage3_prefetch_bucket_size=200,
                              stage3_max_live_parameters=1500, reduce_bucket_size=50), {}),
    "no prefetch": (dict(RELEASED, stage3_prefetch_bucket_size=0), {}),
    "checkpoint": (dict(RELEASED, checkpointing="non_reentrant"), {}),
    "checkpoint reentrant": (dict(RELEASED, checkpointing="reentrant"), {}),
    # the head too: a backward's first gradients then come in a nested one
    "checkpoint reentrant all": (dict(RELEASED, checkpointing="reentrant_all"), {}),
    # states in files, each rank its own
    "nvme offload": (dict(RELEASED, clip=0.05, offload_optimizer={
        "device": "nvme", "nvme_path": tempfile.gettempdir()}), dict(clip=0.05)),
    "eval and modify": (dict(RELEASED, with_eval=True, modify_at=3),
                        dict(with_eval=True, modify_at=3)),
    # a loss term taken inside GatheredParameters: its backward gathers the
    # released parameter again (it read the empty placeholder), and one
    # that reaches no module output still ends (its gradients were lost)
    "penalty in loss": (dict(RELEASED, penalty="in loss", accumulation=2),
                        dict(penalty=True, accumulation=2)),
    "penalty apart": (dict(RELEASED, penalty="apart", accumulation=2),
                      dict(penalty=True, accumulation=2)),
    # each unit's bucket reduced by one reduce_scatter (what NCCL gets by
    # default), with late pieces from nested backwards too
    "reduce_scatter": (dict(RELEASED, clip=0.05, bucket_reduction="reduce_scatter"),
                       dict(clip=0.05)),
    "reduce_scatter reentrant all": (dict(RELEASED, checkpointing="reentrant_all",
                                          bucket_reduction="reduce_scatter"), {}),
    # units kept from forward to backward ([Note: reuse distance]), with the
    # branch that changes the recorded order, evaluations, a change by
    # rank 0, nested backwards and a loss term's late gathers
    "reuse": (dict(RELEASED, stage3_max_reuse_distance=10**9, with_eval=True, modify_at=3),
              dict(with_eval=True, modify_at=3)),
    "reuse reentrant all": (dict(RELEASED, stage3_max_reuse_distance=10**9,
                                 checkpointing="reentrant_all"), {}),
    "reuse penalty": (dict(RELEASED, stage3_max_reuse_distance=100, penalty="in loss",
                           accumulation=2), dict(penalty=True, accumulation=2)),
}
STEPS = 8


def _all_cases(rank, world):
    return {name: scenarios.engine_run(rank, world, STEPS, 3, **opts)
            for name, (opts, _ref) in CASES.items()}


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def runs(request):
    world = request.param
    return world, harness.run(world, _all_cases)


@pytest.fixture(scope="module")
def references():
    return {name: scenarios.reference_run(STEPS, **ref) for name, (_o, ref) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_stage3_matches_single_process(runs, references, case):
    world, results = runs
    ref_losses, ref_state = references[case]
    for rank, result in enumerate(results):
        losses, state, facts = result[case]
        where = f"world {world} {case} rank {rank}"
        assert max_rel_error(torch.tensor(losses), torch.tensor(ref_losses)) <= 1e-5, where
        for name, ref in ref_state.items():
            err = max_rel_error(state[name], ref)
            assert err <= 1e-5, f"{where}: {name} off by {err:.2e}"
        assert (facts["memory"]["offloaded"] > 0) == (case == "nvme offload"), where
        # GatheredParameters read the same values full_state_dict reports
        for name, value in facts["gathered"].items():
            assert torch.equal(value, state[name]), f"{where}: gathered {name}"


def test_released_case_really_released(runs):
    """With threshold 0 nothing is persistent and gathered memory peaks
    below the whole model; with the default every unit of this small model
    is persistent and nothing is gathered on demand."""
    _, results = runs
    released = results[0]["released"][2]["memory"]
    assert released["persistent"] == 0
    assert released["gathered_peak"] > 0
    persistent = results[0]["persistent"][2]["memory"]
    assert persistent["gathered_peak"] == 0 and persistent["persistent"] > 0


def test_reduce_scatter_case_really_scattered(runs):
    """bucket_reduction="reduce_scatter" sends a unit's bucket in one call,
    and no reduce, on several ranks: on gloo the all-reduce its
    reduce_scatter runs inside, whose handle can be polled (a
    reduce_scatter's never reported done before its wait: every backward
    waited a second, [Note: rank-local gradients]); the default on gloo
    issues reduces. No backward of any case gave up waiting (but one)."""
    world, results = runs
    for result in results:
        for case, (_losses, _state, facts) in result.items():
            # the fault stalled 3 of 8 backwards; one is let pass (a rank of
            # 3 on 2 cores may lose the CPU for a second on a loaded machine)
            assert facts["stalls"] <= 1, f"world {world} {case}: {facts['stalls']} stalls"
    if world == 1:
        return  # one rank reduces nothing
    scattered = results[0]["reduce_scatter"][2]["comm"]["ops"]
    assert scattered.get("all_reduce", {}).get("calls", 0) > 0, scattered
    assert "reduce" not in scattered and "reduce_scatter" not in scattered, scattered
    reduced = results[0]["released"][2]["comm"]["ops"]
    assert "reduce_scatter" not in reduced and reduced["reduce"]["calls"] > 0, reduced

"""Stages 0, 1 and 2 on 1, 2 and 3 gloo ranks against a single-process
torch.optim reference on the full batch (tests/distributed/scenarios.py).

Tolerance: fp32, max relative error (normwise) 1e-5 on the final parameters
and the per-step losses. The engine sums gradients over ranks in a different
order than one process does (a few ulps), and its AdamW pass differs from
torch's by a few ulps per step (tests/test_optim_parity.py): ~1e-7 per step,
~1e-6 after 20 steps."""
import tempfile

import pytest
import torch

import harness
import scenarios
from conftest import max_rel_error

STEPS = 20
WORLDS = [1, 2, 3]
STAGES = [0, 1, 2]
NVME = {"device": "nvme", "nvme_path": tempfile.gettempdir()}


def _all_cases(rank, world):
    out = {}
    for stage in STAGES:
        out[("plain", stage)] = scenarios.engine_run(rank, world, STEPS, stage)
        out[("sgd", stage)] = scenarios.engine_run(rank, world, 10, stage, opt="sgd", lr=0.1)
        out[("accumulate", stage)] = scenarios.engine_run(rank, world, 8, stage, accumulation=2,
                                                          opt="sgd", lr=0.1)
        out[("clip", stage)] = scenarios.engine_run(rank, world, 8, stage, clip=0.05)
        # a tiny bucket, so stage 2 reduces many buckets during backward
        out[("small buckets", stage)] = scenarios.engine_run(rank, world, 6, stage,
                                                             reduce_bucket_size=50)
        # reentrant checkpointing around the block and the head: gradients
        # arrive in nested backwards, some parameters' in several parts
        out[("checkpoint", stage)] = scenarios.engine_run(rank, world, 6, stage,
                                                          checkpointing="reentrant_all",
                                                          reduce_bucket_size=50)
        # states in files, each rank its own (one chunk at this size; many in
        # test_offload_ranks.py)
        out[("nvme offload", stage)] = scenarios.engine_run(rank, world, 8, stage,
                                                            accumulation=2, clip=0.05,
                                                            offload_optimizer=NVME)
        # stage 2's one unit reduced by reduce_scatters (NCCL's default),
        # whole in one bucket and in many
        out[("reduce scatter", stage)] = scenarios.engine_run(
            rank, world, 8, stage, clip=0.05, bucket_reduction="reduce_scatter")
        out[("reduce scatter small buckets", stage)] = scenarios.engine_run(
            rank, world, 6, stage, reduce_bucket_size=50, bucket_reduction="reduce_scatter")
        # the GPU's torch-op step (its norm is summed over ranks as a tensor)
        with scenarios.torch_step():
            out[("torch step", stage)] = scenarios.engine_run(rank, world, 8, stage,
                                                              accumulation=2, clip=0.05)
    return out


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def runs(request):
    world = request.param
    return world, harness.run(world, _all_cases)


@pytest.fixture(scope="module")
def references():
    return {
        "plain": scenarios.reference_run(STEPS),
        "sgd": scenarios.reference_run(10, opt="sgd", lr=0.1),
        "accumulate": scenarios.reference_run(8, accumulation=2, opt="sgd", lr=0.1),
        "clip": scenarios.reference_run(8, clip=0.05),
        "small buckets": scenarios.reference_run(6),
        "checkpoint": scenarios.reference_run(6),
        "torch step": scenarios.reference_run(8, accumulation=2, clip=0.05),
        "nvme offload": scenarios.reference_run(8, accumulation=2, clip=0.05),
        "reduce scatter": scenarios.reference_run(8, clip=0.05),
        "reduce scatter small buckets": scenarios.reference_run(6),
    }


def check(case, losses, state, reference):
    ref_losses, ref_state = reference
    assert max_rel_error(torch.tensor(losses), torch.tensor(ref_losses)) <= 1e-5, case
    for name, ref in ref_state.items():
        err = max_rel_error(state[name], ref)
        assert err <= 1e-5, f"{case}: {name} off by {err:.2e}"


@pytest.mark.parametrize("case", ["plain", "sgd", "accumulate", "clip", "small buckets",
                                  "checkpoint", "torch step", "nvme offload", "reduce scatter",
                                  "reduce scatter small buckets"])
@pytest.mark.parametrize("stage", STAGES)
def test_matches_single_process(runs, references, case, stage):
    world, results = runs
    for rank, result in enumerate(results):
        losses, state, facts = result[(case, stage)]
        check(f"world {world} stage {stage} {case} rank {rank}", losses, state,
              references[case])
        # the states were in files: 8 bytes per element of this rank's part
        memory = facts["memory"]
        part = memory["trainable_params"] // (world if stage else 1)
        assert (memory["offloaded"] >= 8 * part) == (case == "nvme offload"), memory


def test_loss_falls(runs):
    _, results = runs
    losses = results[0][("plain", 2)][0]
    assert sum(losses[-5:]) < sum(losses[:5])

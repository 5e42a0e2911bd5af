"""zero.partitioned_init on 2 and 3 gloo ranks: the parameters come out
bit-identical to a plain construction with the same seed, and no rank ever
holds the whole model.

Memory is the process's resident set (VmHWM after resetting it through
/proc/self/clear_refs), under glibc's default settings: construction gives
each parameter's freed full values back to the system itself (it held
nearly the whole model when a test told glibc to unmap every block of
64 KiB or more, MALLOC_MMAP_THRESHOLD_, and a user's run did not). Bounds
(the issue's): construction
peaks below 1.2 x (this rank's fp32 parameter chunks + the largest layer);
construction plus zero.initialize(stage=3, bf16, AdamW) peaks below 1.2 x
(16Ψ/N model states + the largest layer). Holding the full fp32 model even
once would break either bound for this model (24 layers: the model is 4Ψ
bytes, the largest layer Ψ/6 bytes)."""
import gc
import os

import pytest
import torch
from torch import nn

import harness

WORLDS = [2, 3]
LAYERS, WIDTH = 24, 384


def build():
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak():
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status()["VmRSS"]


def construct(rank, world):
    import zero
    # warm up every code path once, so first-use allocations are not counted
    torch.manual_seed(0)
    with zero.partitioned_init():
        small = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    zero.initialize(small, optimizer=torch.optim.AdamW(small.parameters()), stage=3,
                    precision="bf16").close()
    del small

    base = _reset_peak()
    torch.manual_seed(1234)
    with zero.partitioned_init():
        model = build()
    construct_peak = _status()["VmHWM"] - base
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             precision="bf16", stage3_param_persistence_threshold=0)
    total_peak = _status()["VmHWM"] - base
    memory = dict(engine.memory_summary())
    state = engine.full_state_dict()
    # a module built on rank 0 alone inside the context (no gather in its
    # init, so nothing failed there): refused on every rank on leaving
    diverged = None
    try:
        torch.manual_seed(7)
        with zero.partitioned_init():
            nn.Linear(8, 8)
            if rank == 0:
                nn.Linear(4, 4)
    except RuntimeError as error:
        diverged = str(error)
    return dict(construct_peak=construct_peak, total_peak=total_peak, memory=memory,
                state=state, diverged=diverged)


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def runs(request):
    return request.param, harness.run(request.param, construct)


def test_values_equal_plain_construction(runs):
    _, results = runs
    torch.manual_seed(1234)
    reference = build().state_dict()
    for rank, result in enumerate(results):
        for name, value in reference.items():
            # bf16 engine: its fp32 master was seeded from the fp32 values
            assert torch.equal(result["state"][name], value), f"rank {rank}: {name}"


def test_no_rank_holds_the_whole_model(runs):
    world, results = runs
    psi = LAYERS * (WIDTH * WIDTH + WIDTH)
    layer_bytes = (WIDTH * WIDTH + WIDTH) * 4
    chunks = 4 * psi / world
    for rank, result in enumerate(results):
        assert result["construct_peak"] <= 1.2 * (chunks + layer_bytes), (rank, result)
        states = result["memory"]["model_states"]
        assert abs(states - 16 * psi / world) <= 0.05 * 16 * psi / world
        assert result["total_peak"] <= 1.2 * (16 * psi / world + layer_bytes), (rank, result)
        # the bound is tight enough to catch the whole model held once
        assert 4 * psi > 1.2 * (chunks + layer_bytes)


def test_a_module_built_on_some_ranks_only_is_refused_on_leaving(runs):
    _, results = runs
    for r in results:
        assert "the ranks differ in their random state or in how many parameters" in \
            r["diverged"]

"""Shared fixtures: every SIMD path this CPU can run, set for one test."""
import pytest
import torch

import zero

SIMD_PATHS = zero.cpu_info()["available"]


@pytest.fixture(autouse=True, scope="module")
def release_the_group_partitioned_init_keeps():
    """zero.partitioned_init leaves its one-process group for the life of
    the process, by design (docs/stage3.md). A test module that used it
    leaves, under pytest-xdist, that group to whichever module the worker
    runs next: test_lifecycle's check that engines take their group with
    them then failed on a group that was not its engines'."""
    yield
    import os
    import torch.distributed as dist
    from zero.comm import _comm
    if "RANK" not in os.environ and _comm._holds_current_group():
        _comm._forget_group()
        dist.destroy_process_group()


@pytest.fixture
def deepspeed_script(monkeypatch):
    """One process with no launcher variables, as a DeepSpeed script run by
    python alone: the default group deepspeed.initialize (or
    init_distributed) makes is the script's, which the engine keeps, so it
    is destroyed here after the test."""
    from engine_cases import no_launcher
    no_launcher(monkeypatch)
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(params=SIMD_PATHS)
def simd(request):
    previous = zero._C.set_simd(request.param)
    yield request.param
    zero._C.set_simd(previous)


def max_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|: a normwise relative error. Per-element
    ratios are meaningless for elements that pass through zero, where a
    one-ulp difference of the inputs is a large fraction of the value."""
    ref = ref.detach().double()
    return float((ours.detach().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def rand(n, seed, dtype=torch.float32, scale=1.0, positive=False):
    """n seeded normal values (times scale, absolute if positive) in dtype."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    return (x.abs() if positive else x).to(dtype)


def bits(t):
    """The tensor's bits, for exact comparisons of 16-bit floats."""
    return t.detach().cpu().view(torch.int16 if t.element_size() == 2 else torch.int32)

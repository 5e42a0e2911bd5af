"""Shared fixtures: every SIMD path this CPU can run, set for one test."""
import pytest
import torch

import zero

SIMD_PATHS = zero.cpu_info()["available"]


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

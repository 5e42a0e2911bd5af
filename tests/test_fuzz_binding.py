"""Hypothesis drives zero._C.adam_step with random shapes, dtypes, strides,
offsets and values. Every call either raises TypeError/ValueError, leaving
the buffers as they were, or gives the result of a plain torch reference
(upcast gradient, torch ops, fp32)."""
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zero import _C

# Each property is valid most of the time, so that a fair share of calls
# pass validation and are checked against the reference.
DTYPES = [torch.float32] * 8 + [torch.bfloat16, torch.float16, torch.float64, torch.int32]
LAYOUTS = ["plain"] * 8 + ["strided", "offset", "2d-t"]
OUTCOMES = {"accepted": 0, "rejected": 0}


def reference_adamw(p, g, m, v, lr, beta1, beta2, eps, wd, step, scale):
    g = g.float() * scale
    p = p * (1 - lr * wd)
    m = torch.lerp(m, g, 1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    denom = v.sqrt() / math.sqrt(1 - beta2 ** step) + eps
    return p - lr / (1 - beta1 ** step) * (m / denom), m, v


@st.composite
def tensor(draw, n):
    """A tensor of n elements in some dtype, maybe strided or offset."""
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    values = torch.randn(2 * n + 3, generator=torch.Generator().manual_seed(
        draw(st.integers(0, 2**31)))) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    base = values.to(dtype) if dtype != torch.int32 else values.to(torch.int32)
    if layout == "strided":
        return base[: 2 * n: 2] if n else base[:0]
    if layout == "offset":
        return base[1: n + 1]
    if layout == "2d-t" and n >= 4 and n % 2 == 0:
        return base[:n].view(2, n // 2).t()
    return base[:n].clone()


# derandomize: the same 300 examples on every run, so the count of accepted
# calls (about 1 in 10 pass every check) cannot fall short by chance
@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(0, 300))
def fuzz_adam_step(data, n):
    sizes = [n if i == 0 or data.draw(st.integers(0, 9)) else data.draw(st.integers(0, 300))
             for i in range(4)]
    p, g, m, v = (data.draw(tensor(s)) for s in sizes)
    m = m.abs() if m.dtype.is_floating_point else m
    v = v.abs() if v.dtype.is_floating_point else v
    lr = data.draw(st.sampled_from([1e-3] * 6 + [0.1, -1.0, float("nan")]))
    beta1 = data.draw(st.sampled_from([0.9] * 6 + [0.0, 1.0]))
    beta2 = data.draw(st.sampled_from([0.999] * 6 + [0.5, -0.1]))
    eps = data.draw(st.sampled_from([1e-8, 0.0]))
    wd = data.draw(st.sampled_from([0.0, 0.01]))
    step = data.draw(st.sampled_from([1, 2, 5] * 3 + [0, -3]))
    scale = data.draw(st.sampled_from([1.0] * 6 + [0.5, float("inf")]))
    before = [t.clone() for t in (p, g, m, v)]
    try:
        _C.adam_step(p, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=wd, step=step, grad_scale=scale)
    except (TypeError, ValueError):
        OUTCOMES["rejected"] += 1
        for t, b in zip((p, g, m, v), before):
            assert torch.equal(t, b) or (t.isnan() == b.isnan()).all()
        return
    OUTCOMES["accepted"] += 1
    # accepted: every argument must have been valid
    assert all(t.is_contiguous() for t in (p, g, m, v))
    assert p.dtype == m.dtype == v.dtype == torch.float32
    assert len({p.numel(), g.numel(), m.numel(), v.numel()}) == 1
    assert lr >= 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1 and step >= 1
    assert math.isfinite(scale)
    want_p, want_m, want_v = reference_adamw(before[0], before[1], before[2], before[3],
                                             lr, beta1, beta2, eps, wd, step, scale)
    for got, want in ((p, want_p), (m, want_m), (v, want_v)):
        close = torch.isclose(got, want, rtol=1e-5, atol=1e-6) | (got.isnan() & want.isnan())
        assert close.all(), (got - want).abs().max()


def test_adam_step_fuzz_takes_both_outcomes():
    """The fuzz run, then a check that both branches were taken (in one
    test, so that pytest-xdist cannot split the run from the count)."""
    OUTCOMES.update(accepted=0, rejected=0)
    fuzz_adam_step()
    assert OUTCOMES["accepted"] >= 10 and OUTCOMES["rejected"] >= 10, OUTCOMES

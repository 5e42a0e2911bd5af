"""Parity of zero.optim with torch.optim over 200 steps of random gradients,
on every SIMD path this CPU has.

Tolerance: fp32, max relative error (normwise, conftest.max_rel_error) at
most 1e-5. Each step differs from torch's by a few ulps (torch's vectorized
kernels order some operations differently), about 1e-7 relative; over 200 steps
these add up, mostly cancelling, to ~1e-6. 1e-5 leaves a margin of ~10 and
still fails on any wrong formula (a wrong bias correction alone is ~1e-3).
"""
import pytest
import torch

import zero
from conftest import max_rel_error

STEPS = 200
SHAPES = [(7, 13), (33,), (1,), (5, 3, 2), (129,)]


def make_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def lion_reference(params, grads_per_step, lr, betas, weight_decay):
    """Lion from its paper's pseudo-code, in plain torch ops."""
    beta1, beta2 = betas
    params = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for p, mi, g in zip(params, m, grads):
            c = beta1 * mi + (1 - beta1) * g
            p.mul_(1 - lr * weight_decay).add_(torch.sign(c), alpha=-lr)
            mi.mul_(beta2).add_(g, alpha=1 - beta2)
    return params


CASES = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.05)),
    ("AdamW", dict(lr=3e-3, betas=(0.8, 0.99), amsgrad=True)),
    ("Adam", dict(lr=1e-2, weight_decay=1e-3)),
    ("Adam", dict(lr=1e-2, amsgrad=True, maximize=True)),
    ("SGD", dict(lr=0.05)),
    ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=0.05, momentum=0.5, dampening=0.3)),
    ("Adagrad", dict(lr=0.1)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.01, weight_decay=1e-3,
                     initial_accumulator_value=0.1)),
]


def random_grads(seed, steps):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_matches_torch(simd, name, kwargs):
    init = make_params(0)
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    theirs = [torch.nn.Parameter(p.clone()) for p in init]
    # two param groups with different hyperparameters
    base_lr = kwargs["lr"]
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": base_lr / 2}]  # noqa: E731
    opt = getattr(zero.optim, name)(groups(ours), **kwargs)
    ref = getattr(torch.optim, name)(groups(theirs), foreach=False, **kwargs)
    for grads in random_grads(1, STEPS):
        for params, o in ((ours, opt), (theirs, ref)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            o.step()
    errors = [max_rel_error(a, b) for a, b in zip(ours, theirs)]
    print(f"{simd} {name} {kwargs}: max rel error {max(errors):.2e}")
    assert max(errors) <= 1e-5, errors
    # states too
    for a, b in zip(ours, theirs):
        for key, value in ref.state[b].items():
            if key == "step":
                assert float(opt.state[a]["step"]) == float(value)
            else:
                assert max_rel_error(opt.state[a][key], value) <= 1e-5, key


def test_lion_matches_paper_reference(simd):
    init = make_params(2)
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    steps = random_grads(3, STEPS)
    opt = zero.optim.Lion(ours, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    for grads in steps:
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
    expected = lion_reference(init, steps, 1e-3, (0.9, 0.99), 0.1)
    errors = [max_rel_error(a, b) for a, b in zip(ours, expected)]
    print(f"{simd} Lion: max rel error {max(errors):.2e}")
    assert max(errors) <= 1e-5


def test_lion_defaults_are_the_papers():
    opt = zero.optim.Lion([torch.nn.Parameter(torch.randn(3))])
    assert opt.defaults["lr"] == 1e-4 and opt.defaults["betas"] == (0.9, 0.99)


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD", "Adagrad"])
def test_defaults_match_torch(name):
    import inspect
    ours = inspect.signature(getattr(zero.optim, name).__init__).parameters
    theirs = inspect.signature(getattr(torch.optim, name).__init__).parameters
    assert list(ours) == list(theirs) or set(ours) == set(theirs)
    for key, p in theirs.items():
        assert ours[key].default == p.default, key


def test_params_without_grad_are_skipped_like_torch(simd):
    init = make_params(4)
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    theirs = [torch.nn.Parameter(p.clone()) for p in init]
    opt = zero.optim.AdamW(ours, lr=1e-2)
    ref = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    for step, grads in enumerate(random_grads(5, 30)):
        for params, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            for i, (p, g) in enumerate(zip(params, grads)):
                if (i + step) % 3 != 0:  # a changing subset has no grad
                    p.grad = g.clone()
            o.step()
    for a, b in zip(ours, theirs):
        assert max_rel_error(a, b) <= 1e-5
        assert float(opt.state[a]["step"]) == float(ref.state[b]["step"])


def test_set_to_none_false_accumulates_in_place(simd):
    model = torch.nn.Linear(6, 4)
    ref_model = torch.nn.Linear(6, 4)
    ref_model.load_state_dict(model.state_dict())
    opt = zero.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(6)
    for _ in range(20):
        x = torch.randn(5, 6, generator=g)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad(set_to_none=False)
            for _micro in range(2):  # gradient accumulation
                m(x).square().mean().backward()
            o.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert max_rel_error(a, b) <= 1e-5
    # after the first step the gradients are views of the flat buffer
    seg = opt._segments[0][0]
    assert model.weight.grad.data_ptr() == seg.grad_flat.data_ptr()


@pytest.mark.parametrize("name,kwargs", CASES + [("Lion", dict(lr=1e-3, weight_decay=0.1))],
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES + [("Lion", 0)])])
def test_every_simd_path_gives_the_scalar_bits(name, kwargs):
    """The SIMD kernels compute the scalar reference's operations in its
    order, without fused multiply-adds, so every path gives the same bits:
    an element's result does not depend on whether it lands in a vector or
    a tail, nor on which machine a run resumes. (Before, AVX2/AVX-512 fused
    where the scalar code rounds twice: 1-ulp differences.)"""
    results = {}
    grads = random_grads(3, 20)
    for path in zero.cpu_info()["available"]:
        previous = zero._C.set_simd(path)
        try:
            params = [p.requires_grad_() for p in make_params(2)]
            opt = getattr(zero.optim, name)(params, **kwargs)
            for step_grads in grads:
                for p, g in zip(params, step_grads):
                    p.grad = g.clone()
                opt.step()
            results[path] = [p.detach().clone() for p in params]
        finally:
            zero._C.set_simd(previous)
    scalar = results["scalar"]
    for path, params in results.items():
        for p, q in zip(params, scalar):
            assert torch.equal(p.view(torch.int32), q.view(torch.int32)), path


NONFINITE_CASES = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.0)),
    ("Adam", dict(lr=1e-2, amsgrad=True)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("Adagrad", dict(lr=0.1)),
]


@pytest.mark.parametrize("name,kwargs", NONFINITE_CASES,
                         ids=[n for n, _ in NONFINITE_CASES])
def test_non_finite_values_go_where_torchs_go(simd, name, kwargs):
    """An inf parameter stays inf without weight decay (0 * inf made it
    NaN), and a NaN gradient spreads into amsgrad's running max as
    torch.maximum spreads it (fmaxf dropped it): the same NaN/inf pattern
    as torch in parameters and states, in vector bodies and tails."""
    ours = [torch.nn.Parameter(p.clone()) for p in make_params(4)]
    theirs = [torch.nn.Parameter(p.clone()) for p in make_params(4)]
    for params in (ours, theirs):
        with torch.no_grad():
            params[0][0, 0], params[0][3, 12] = float("inf"), -float("inf")
            params[4][100] = float("inf")
    opt = getattr(zero.optim, name)(ours, **kwargs)
    ref = getattr(torch.optim, name)(theirs, foreach=False, **kwargs)
    for step, grads in enumerate(random_grads(5, 3)):
        if step == 1:
            grads[4][0], grads[4][128] = float("nan"), float("nan")  # a body, a tail
        for params, o in ((ours, opt), (theirs, ref)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            o.step()
    for a, b in zip(ours, theirs):
        pairs = [(a.detach(), b.detach())] + \
            [(opt.state[a][k], v) for k, v in ref.state[b].items() if k != "step"]
        for x, y in pairs:
            assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.isinf(), y.isinf())
            finite = x.isfinite()
            assert torch.equal(x[~finite].nan_to_num(), y[~finite].nan_to_num())
            assert max_rel_error(x[finite], y[finite]) <= 1e-5

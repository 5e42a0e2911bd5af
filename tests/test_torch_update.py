"""zero.step._torch_update (the optimizer updates in plain torch ops) against the
C scalar reference, zero._C.*_step on CPU copies: random data of odd sizes,
five consecutive steps, grads in fp32, bf16 and fp16, grad_scale != 1 and
negative (maximize), every option of each optimizer. Runs on the CPU, and on
the GPU too where there is one.

fp32 results within 1e-6 (normwise relative, conftest's max_rel_error): each
op rounds where the reference rounds, except torch's CPU sqrt (MKL's vector
sqrt), which is within an ulp but not correctly rounded; an ulp of Adam's or
Adagrad's denominator is ~1e-7 of one step's update, far below 1e-6, while
a wrong formula or constant is typically 1e-4 or more. The order of the
operations, an ulp each, is checked bit for bit with a correctly rounded
sqrt (test_rounds_where_the_reference_rounds). bf16/fp16 copy-outs must
equal torch's cast of our own fp32 result bit for bit.
"""
import pytest
import torch

from conftest import bits, max_rel_error, rand
from zero import _C
from zero.step import _torch_update as tu

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SIZES = [1, 33, 4097, 100_003]
STEPS = 5
TOL = 1e-6  # one ulp of a denominator (torch's CPU sqrt) is ~1e-7 of an update; see above
# (grad dtype, copy_out dtype): every grad dtype, every copy_out dtype and none
GRAD_COPY = [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
             (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
             (torch.bfloat16, torch.float32)]
GRAD_COPY_IDS = ["f32-none", "bf16-bf16", "f16-f16", "f32-bf16", "bf16-f32"]


@pytest.fixture(autouse=True)
def scalar_reference():
    previous = _C.set_simd("scalar")
    yield
    _C.set_simd(previous)


@pytest.fixture(autouse=True)
def one_torch_thread():
    # Elementwise results do not depend on the thread count, and on a small
    # shared machine each of torch's OpenMP barriers can cost milliseconds.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def compare(c_fn, our_fn, tensors, grad_dtype, copy_dtype, device, kwargs_for, seed=100):
    """STEPS updates of `tensors` ([param, *states], None for an absent
    state) by the C reference and by ours; the normwise error of each fp32
    result. Checks the copy-out against our own param, bit for bit."""
    n = tensors[0].numel()
    ref = [None if t is None else t.clone() for t in tensors]
    ours = [None if t is None else t.to(device, copy=True) for t in tensors]
    our_copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype, device=device)
    for step in range(1, STEPS + 1):
        g = rand(n, seed + step, grad_dtype, scale=0.5 + 0.25 * step)
        kwargs = kwargs_for(step)
        c_fn(ref[0], g, *ref[1:], copy_out=None, **kwargs)  # ours is checked against ours
        our_fn(ours[0], g.to(device), *ours[1:], copy_out=our_copy, **kwargs)
    if our_copy is not None:
        assert torch.equal(bits(our_copy), bits(ours[0].to(copy_dtype)))
    return [max_rel_error(got.cpu(), want) for got, want in zip(ours, ref) if want is not None]


# ---- the cases: each optimizer's options --------------------------------

ADAM = [
    dict(decoupled=True, weight_decay=0.01, grad_scale=0.5),
    dict(decoupled=True, weight_decay=0.0, grad_scale=-1.0),
    dict(decoupled=False, weight_decay=0.01, grad_scale=1 / 1024),
    dict(decoupled=False, weight_decay=0.0, amsgrad=True, grad_scale=-0.25),
    dict(decoupled=True, weight_decay=0.05, amsgrad=True, grad_scale=2.0),
    # beta1 < 0.5: the lerp's other form (weight 1 - beta1 >= 0.5)
    dict(decoupled=False, weight_decay=0.1, beta1=0.2, beta2=0.6, amsgrad=True),
]
SGD = [
    dict(grad_scale=0.5),
    dict(weight_decay=1e-3, grad_scale=-1.0),
    dict(momentum=0.9, weight_decay=1e-3, grad_scale=0.25),
    dict(momentum=0.9, nesterov=True, grad_scale=-0.5),
    dict(momentum=0.5, dampening=0.3, weight_decay=1e-2, grad_scale=-1.0),
    # a buffer carried over (never first_step), dampening 1: no new gradient
    dict(momentum=0.7, dampening=1.0, first_step=False),
]
ADAGRAD = [
    dict(grad_scale=0.5),
    dict(lr_decay=0.01, weight_decay=1e-3, grad_scale=-1.0, initial_accumulator=0.1),
    dict(lr_decay=0.5, eps=1e-3, grad_scale=-0.125, initial_accumulator=2.0),
]
LION = [
    dict(grad_scale=0.5),
    dict(beta1=0.95, beta2=0.98, weight_decay=0.1, grad_scale=-1.0),
    # both lerps in their other form
    dict(beta1=0.2, beta2=0.4, weight_decay=0.5, grad_scale=4.0),
]


def adam_run(case, n, grad_dtype, copy_dtype, device):
    case = dict(case)
    amsgrad = case.get("amsgrad", False)
    hp = dict(lr=1e-2, beta1=case.pop("beta1", 0.9), beta2=case.pop("beta2", 0.999), eps=1e-8)
    tensors = [rand(n, 1), rand(n, 2, scale=0.1), rand(n, 3, scale=0.01, positive=True),
               rand(n, 4, scale=0.02, positive=True) if amsgrad else None]
    return compare(_C.adam_step, tu.adam, tensors, grad_dtype, copy_dtype, device,
                   lambda step: dict(hp, step=step, **case))


def sgd_run(case, n, grad_dtype, copy_dtype, device):
    case = dict(case)
    always = case.pop("first_step", None)  # else first_step on step 1, as the engine does
    buf = rand(n, 2, scale=0.1) if case.get("momentum") else None
    return compare(_C.sgd_step, tu.sgd, [rand(n, 1), buf], grad_dtype, copy_dtype, device,
                   lambda step: dict(lr=0.05, first_step=step == 1 if always is None else always,
                                     **case))


def adagrad_run(case, n, grad_dtype, copy_dtype, device):
    case = dict(case)
    state = torch.full((n,), case.pop("initial_accumulator", 0.0))
    return compare(_C.adagrad_step, tu.adagrad, [rand(n, 1), state], grad_dtype, copy_dtype,
                   device, lambda step: dict(lr=0.1, step=step, **case))


def lion_run(case, n, grad_dtype, copy_dtype, device):
    case = dict(case)
    hp = dict(lr=1e-3, beta1=case.pop("beta1", 0.9), beta2=case.pop("beta2", 0.99))
    return compare(_C.lion_step, tu.lion, [rand(n, 1), rand(n, 2, scale=0.1)], grad_dtype,
                   copy_dtype, device, lambda step: dict(hp, **case))


RUNS, RUN_IDS = [], []
for _run, _cases in [(adam_run, ADAM), (sgd_run, SGD), (adagrad_run, ADAGRAD),
                     (lion_run, LION)]:
    RUNS += [(_run, c) for c in _cases]
    RUN_IDS += [f"{_run.__name__[:-4]}{i}" for i in range(len(_cases))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype,copy_dtype", GRAD_COPY, ids=GRAD_COPY_IDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("run,case", RUNS, ids=RUN_IDS)
def test_matches_scalar_reference(run, case, n, grad_dtype, copy_dtype, device):
    errors = run(case, n, grad_dtype, copy_dtype, device)
    assert max(errors) <= TOL, errors


@pytest.mark.parametrize("run,case", RUNS, ids=RUN_IDS)
def test_rounds_where_the_reference_rounds(monkeypatch, run, case):
    """With torch's CPU sqrt replaced by a correctly rounded one, every
    result equals the reference's bit for bit: the formulas take the
    reference's operations in its order, with its float constants."""
    real_sqrt = torch.sqrt

    def correctly_rounded_sqrt(x, *, out=None):
        root = real_sqrt(x.double()).float()
        return root if out is None else out.copy_(root)

    monkeypatch.setattr(torch, "sqrt", correctly_rounded_sqrt)
    for grad_dtype, copy_dtype in GRAD_COPY[:3]:
        errors = run(case, 4097, grad_dtype, copy_dtype, "cpu")
        assert not any(errors), (grad_dtype, errors)


@pytest.mark.parametrize("name,states,kwargs", [
    ("adam", 3, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1,
                     decoupled=False, amsgrad=True)),
    ("sgd", 1, dict(lr=1e-2, momentum=0.9, weight_decay=0.1, first_step=True)),
    ("adagrad", 1, dict(lr=1e-2, weight_decay=0.1, step=1)),
    # the reference's sign of nan is 0, which leaves the parameter alone
    ("lion", 1, dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)),
])
def test_non_finite_grads_land_where_the_reference_puts_them(name, states, kwargs):
    g = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1e-30])
    ref = [torch.linspace(-1, 1, 7)] + [torch.zeros(7) for _ in range(states)]
    ours = [t.clone() for t in ref]
    getattr(_C, f"{name}_step")(ref[0], g, *ref[1:], **kwargs)
    getattr(tu, name)(ours[0], g, *ours[1:], **kwargs)
    for got, want in zip(ours, ref):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(nan=0.0), want.nan_to_num(nan=0.0))


def test_start_stop_updates_only_the_range():
    n = 1000
    ref = [rand(n, 1), rand(n, 2, scale=0.1), rand(n, 3, scale=0.01, positive=True)]
    ours = [t.clone() for t in ref]
    before = ref[0].clone()
    g = rand(n, 4, torch.bfloat16)
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1,
                  start=100, stop=777)
    _C.adam_step(ref[0], g, *ref[1:], **kwargs)
    tu.adam(ours[0], g, *ours[1:], **kwargs)
    for got, want in zip(ours, ref):
        assert max_rel_error(got, want) <= TOL
    assert torch.equal(ours[0][:100], before[:100]) and torch.equal(ours[0][777:], before[777:])
    assert not torch.equal(ours[0][100:777], before[100:777])


def test_unused_buffers_are_checked_and_left_alone():
    p, g, buf = rand(64, 1), rand(64, 2), rand(64, 3)
    before = buf.clone()
    tu.sgd(p, g, buf, lr=0.1, momentum=0.0, first_step=True)
    tu.adam(p, g, rand(64, 4), rand(64, 5, positive=True), buf, lr=0.1, beta1=0.9, beta2=0.99,
            eps=1e-8, weight_decay=0.0, step=1)
    assert torch.equal(buf, before)
    with pytest.raises(ValueError, match="momentum_buffer has 63 elements"):
        tu.sgd(p, g, buf[:63], lr=0.1)
    with pytest.raises(ValueError, match="max_exp_avg_sq must be float32"):
        tu.adam(p, g, rand(64, 4), rand(64, 5, positive=True), buf.half(), lr=0.1, beta1=0.9,
                beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)


def test_param_requiring_grad():
    # the engine's masters may be leaves that require grad
    p = rand(33, 1).requires_grad_()
    tu.sgd(p, rand(33, 2), lr=0.1)
    assert p.requires_grad and p.grad is None


# ---- bad arguments --------------------------------------------------------


def adam_args(n=64):
    tensors = dict(param=rand(n, 1), grad=rand(n, 2), exp_avg=rand(n, 3),
                   exp_avg_sq=rand(n, 4, positive=True))
    return tensors, dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


@pytest.mark.parametrize("change,message", [
    (dict(param=rand(64, 1, torch.float16)), "param must be float32, got torch.float16"),
    (dict(exp_avg=rand(64, 1, torch.float64)), "exp_avg must be float32"),
    (dict(exp_avg_sq=rand(64, 1, torch.bfloat16)), "exp_avg_sq must be float32"),
    (dict(grad=rand(64, 1).to(torch.float64)), "grad must be float32, bfloat16 or float16"),
    (dict(copy_out=torch.zeros(64, dtype=torch.int16)), "copy_out must be float32, bfloat16"),
    (dict(grad=rand(63, 1)), "grad has 63 elements, param has 64"),
    (dict(exp_avg_sq=rand(65, 1)), "exp_avg_sq has 65 elements"),
    (dict(copy_out=torch.zeros(32, dtype=torch.bfloat16)), "copy_out has 32 elements"),
    (dict(exp_avg=rand(128, 1)[::2]), "exp_avg is not contiguous"),
    (dict(exp_avg=torch.zeros(64, device="meta")), "exp_avg is on meta, param on cpu"),
    (dict(grad=[0.0] * 64), "grad must be a torch.Tensor"),
    (dict(amsgrad=True), "amsgrad=True needs the max_exp_avg_sq buffer"),
    (dict(lr=-1.0), "lr must be a finite number >= 0, got -1.0"),
    (dict(lr=float("nan")), "lr must be a finite number >= 0, got nan"),
    (dict(beta1=1.0), r"beta1 must be in \[0, 1\), got 1.0"),
    (dict(beta2=-0.1), r"beta2 must be in \[0, 1\)"),
    (dict(eps=float("inf")), "eps must be a finite number >= 0"),
    (dict(weight_decay=-0.5), "weight_decay must be"),
    (dict(step=0), "step must be >= 1, got 0"),
    (dict(grad_scale=float("inf")), "grad_scale must be finite"),
    (dict(start=10, stop=5), "start=10, stop=5 is not a range within the 64 elements"),
    (dict(stop=65), "start=0, stop=65 is not a range"),
], ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}" for k in x))
def test_adam_bad_arguments(change, message):
    tensors, hp = adam_args()
    for key, value in change.items():
        (tensors if key in ("param", "grad", "exp_avg", "exp_avg_sq", "copy_out")
         else hp)[key] = value
    before = {k: t.clone() for k, t in tensors.items()
              if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
    with pytest.raises(ValueError, match=message):
        tu.adam(**tensors, **hp)
    for key, t in before.items():
        assert torch.equal(tensors[key], t), f"{key} changed"


def test_overlapping_buffers_are_refused():
    tensors, hp = adam_args()
    whole = rand(128, 1)
    tensors["param"], tensors["exp_avg"] = whole[:64], whole[32:96]
    with pytest.raises(ValueError, match="exp_avg and param overlap in memory"):
        tu.adam(**tensors, **hp)
    with pytest.raises(ValueError, match="exp_avg and param overlap"):
        tu.lion(whole[:64], rand(64, 2), whole[63:127], lr=1e-3, beta1=0.9, beta2=0.99)


@pytest.mark.parametrize("call,message", [
    (lambda p, g, s: tu.sgd(p, g, lr=0.1, momentum=0.9), "momentum != 0 needs the momentum_buffer"),
    (lambda p, g, s: tu.sgd(p, g, s, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
     "nesterov=True needs momentum > 0 and dampening 0"),
    (lambda p, g, s: tu.sgd(p, g, lr=0.1, nesterov=True), "nesterov=True needs momentum > 0"),
    (lambda p, g, s: tu.sgd(p, g, s, lr=0.1, momentum=-0.5), "momentum must be a finite number"),
    (lambda p, g, s: tu.sgd(p, g, s, lr=0.1, dampening=float("nan")), "dampening must be finite"),
    (lambda p, g, s: tu.sgd(p, g, s.half(), lr=0.1, momentum=0.9),
     "momentum_buffer must be float32"),
    (lambda p, g, s: tu.adagrad(p, g, s[:10], lr=0.1, step=1), "state_sum has 10 elements"),
    (lambda p, g, s: tu.adagrad(p, g, s, lr=0.1, step=1, lr_decay=-1.0),
     "lr_decay must be a finite number >= 0"),
    (lambda p, g, s: tu.adagrad(p, g, s, lr=0.1, step=0), "step must be >= 1"),
    (lambda p, g, s: tu.adagrad(p, g, s.bfloat16(), lr=0.1, step=1), "state_sum must be float32"),
    (lambda p, g, s: tu.lion(p, g, s, lr=0.1, beta1=0.9, beta2=1.5), r"beta2 must be in \[0, 1\)"),
    (lambda p, g, s: tu.lion(p, g, s.double(), lr=0.1, beta1=0.9, beta2=0.99),
     "exp_avg must be float32"),
    (lambda p, g, s: tu.lion(p, g, s, lr=0.1, beta1=0.9, beta2=0.99, grad_scale=float("nan")),
     "grad_scale must be finite"),
])
def test_other_bad_arguments(call, message):
    p, g, s = rand(64, 1), rand(64, 2), rand(64, 3, positive=True)
    before = (p.clone(), s.clone())
    with pytest.raises(ValueError, match=message):
        call(p, g, s)
    assert torch.equal(p, before[0]) and torch.equal(s, before[1])


def test_missing_hyperparameter_is_a_type_error():
    with pytest.raises(TypeError, match="lr"):
        tu.sgd(rand(4, 1), rand(4, 2))

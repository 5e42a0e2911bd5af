"""The fused mixed-precision step: 16-bit gradients in, a scale factor, fp32
master update, 16-bit parameters out; and the core's conversions and
reductions against torch."""
import pytest
import torch

import zero
from conftest import max_rel_error

N = 4099  # not a multiple of any vector width


def adam_kwargs(step=1, grad_scale=1.0):
    return dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step,
                grad_scale=grad_scale)


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_out_is_torch_cast_bit_for_bit(simd, grad_dtype, copy_dtype):
    g = torch.Generator().manual_seed(0)
    master = torch.randn(N, generator=g)
    grad = torch.randn(N, generator=g).to(grad_dtype)
    m, v = torch.zeros(N), torch.zeros(N)
    copy = torch.empty(N, dtype=copy_dtype)
    for step in range(1, 4):
        zero._C.adam_step(master, grad, m, v, None, copy, **adam_kwargs(step, 0.25))
        assert torch.equal(copy.view(torch.int16), master.to(copy_dtype).view(torch.int16))


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_half_grads_and_scale_match_upcast_reference(simd, grad_dtype):
    """Reading 16-bit gradients and scaling inside the pass equals upcasting
    and scaling first, then a plain fp32 step."""
    g = torch.Generator().manual_seed(1)
    master = torch.randn(N, generator=g)
    grad16 = (torch.randn(N, generator=g) * 1024).to(grad_dtype)
    ref_master = master.clone()
    m, v, rm, rv = (torch.zeros(N) for _ in range(4))
    scale = 1.0 / 1024
    zero._C.adam_step(master, grad16, m, v, **adam_kwargs(1, scale))
    zero._C.adam_step(ref_master, grad16.float() * scale, rm, rv, **adam_kwargs(1))
    assert max_rel_error(master, ref_master) <= 1e-6


def test_bf16_parameters_keep_fp32_master(simd):
    torch.manual_seed(2)
    model = torch.nn.Linear(31, 17).to(torch.bfloat16)
    master_ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = zero.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(master_ref, lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in model.parameters()]
        for p, gr in zip(model.parameters(), grads):
            p.grad = gr
        for p, gr in zip(master_ref, grads):
            p.grad = gr.float()
        opt.step()
        ref.step()
    for p, r in zip(model.parameters(), master_ref):
        assert p.dtype == torch.bfloat16
        assert max_rel_error(opt.state[p]["master_param"], r) <= 1e-5
        assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_convert_matches_torch(simd, dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(N, generator=g) * torch.logspace(-30, 30, N, base=2)
    x[:4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    out = torch.empty(N, dtype=dtype)
    zero._C.convert(out, x)
    assert torch.equal(out.view(torch.int16), x.to(dtype).view(torch.int16))
    back = torch.empty(N)
    zero._C.convert(back, out)
    assert torch.equal(back, out.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_squares_and_finite(simd, dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(100_003, generator=g).to(dtype)
    expected = x.double().square().sum().item()
    assert abs(zero._C.sum_squares(x) - expected) <= 1e-9 * expected
    assert zero._C.all_finite(x)
    x[77_777] = float("nan")
    assert not zero._C.all_finite(x)
    x[77_777] = float("inf")
    assert not zero._C.all_finite(x)
    assert zero._C.sum_squares(x) == float("inf")

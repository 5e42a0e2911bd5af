"""Bad input to zero._C raises an exception that names the argument and the
wrong value; it never crashes and never changes a buffer."""
import math

import pytest
import torch

import zero
from dlpack_fakes import fake_capsule
from zero import _C


def bufs(n=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(4)]


KW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


def assert_unchanged(tensors, before):
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("arg,value,message", [
    ("lr", float("nan"), "lr must be a finite number >= 0, got nan"),
    ("lr", -1.0, "lr must be a finite number >= 0, got -1.0"),
    ("beta1", 1.0, r"beta1 must be in \[0, 1\), got 1.0"),
    ("beta2", -0.1, r"beta2 must be in \[0, 1\), got -0.1"),
    ("eps", float("inf"), "eps must be a finite number >= 0"),
    ("weight_decay", -0.5, "weight_decay must be"),
    ("step", 0, "step must be >= 1, got 0"),
    # finite as a double, an infinity in the kernels' float32 (C hunt:
    # grad_scale=1e39 turned every parameter NaN, with no error)
    ("grad_scale", 1e39, r"grad_scale must be at most 3.4e38 in size \(the kernels compute "
                         r"in float32\), got 1e\+39"),
    ("lr", 1e39, r"lr must be at most 3.4e38 in size"),
    ("eps", 1e39, r"eps must be at most 3.4e38 in size"),
])
def test_bad_hyperparameters(arg, value, message):
    p, g, m, v = bufs()
    before = [t.clone() for t in (p, m, v)]
    with pytest.raises(ValueError, match=message):
        _C.adam_step(p, g, m, v, **{**KW, arg: value})
    assert_unchanged((p, m, v), before)


def test_missing_keyword_is_named():
    p, g, m, v = bufs()
    kw = dict(KW)
    del kw["lr"]
    with pytest.raises(TypeError, match="missing required keyword argument 'lr'"):
        _C.adam_step(p, g, m, v, **kw)


def test_a_value_at_the_end_of_its_range_is_no_missing_argument():
    # a sentinel marked "missing" once: these read as never passed
    p, g, m, v = bufs()
    with pytest.raises(ValueError, match="lr must be a finite number >= 0, got -1.79"):
        _C.adam_step(p, g, m, v, **{**KW, "lr": -1.7976931348623157e308})
    with pytest.raises(ValueError, match="step must be >= 1, got -9223372036854775808"):
        _C.adam_step(p, g, m, v, **{**KW, "step": -2 ** 63})


def test_a_simd_name_with_a_nul_is_refused():
    with pytest.raises(ValueError, match="name must be 'scalar', 'avx2' or 'avx512'"):
        _C.set_simd("scalar\0 and more")


def test_size_mismatch_names_both():
    p, g, m, v = bufs()
    with pytest.raises(ValueError, match="grad has 63 elements, param has 64"):
        _C.adam_step(p, g[:63], m, v, **KW)


def test_wrong_dtype():
    p, g, m, v = bufs()
    with pytest.raises(TypeError, match="exp_avg must be float32, got bfloat16"):
        _C.adam_step(p, g, m.bfloat16(), v, **KW)
    with pytest.raises(TypeError, match="unsupported dtype"):
        _C.adam_step(p, g.double(), m, v, **KW)
    with pytest.raises(TypeError, match="unsupported dtype"):
        _C.adam_step(p, torch.ones(64, dtype=torch.int32), m, v, **KW)


def test_non_contiguous():
    p, g, m, v = bufs(128)
    with pytest.raises(ValueError, match="grad is not contiguous"):
        _C.adam_step(p[:64], g[::2], m[:64], v[:64], **KW)
    square = torch.randn(8, 8)
    with pytest.raises(ValueError, match="param is not contiguous"):
        _C.adam_step(square.t(), g[:64].view(8, 8), m[:64], v[:64], **KW)


def test_overlapping_buffers():
    p, g, m, v = bufs(128)
    with pytest.raises(ValueError, match="exp_avg and param overlap"):
        _C.adam_step(p[:64], g[:64], p[32:96], v[:64], **KW)
    with pytest.raises(ValueError, match="exp_avg_sq and exp_avg overlap"):
        _C.adam_step(p[:64], g[:64], m[:64], m[:64], **KW)


def test_bad_range():
    p, g, m, v = bufs()
    with pytest.raises(ValueError, match="start=10, stop=5"):
        _C.adam_step(p, g, m, v, start=10, stop=5, **KW)
    with pytest.raises(ValueError, match="stop=65"):
        _C.adam_step(p, g, m, v, start=0, stop=65, **KW)


def test_not_a_tensor():
    p, g, m, v = bufs()
    with pytest.raises(TypeError, match="grad must be a tensor .* not list"):
        _C.adam_step(p, [1.0] * 64, m, v, **KW)


@pytest.mark.parametrize("position,name", [(0, "param"), (1, "grad"), (2, "exp_avg")])
def test_none_for_a_buffer_that_has_no_default(position, name):
    # param or grad None crashed the process; a required state gave only
    # "adam_step failed: invalid argument"
    args = bufs()
    args[position] = None
    with pytest.raises(TypeError, match=f"{name} must be a tensor .* not NoneType"):
        _C.adam_step(*args, **KW)
    a, b, _, _ = bufs()
    with pytest.raises(TypeError, match=f"{name} must be a tensor .* not NoneType"):
        _C.lion_step(*([a, b, torch.zeros(64)][:position] + [None]
                       + [a, b, torch.zeros(64)][position + 1:]),
                     lr=0.1, beta1=0.9, beta2=0.99)


def test_convert_refuses_none():
    with pytest.raises(TypeError, match="dst must be a tensor .* not NoneType"):
        _C.convert(None, torch.zeros(4))


def test_tensor_requiring_grad_is_explained():
    p = torch.nn.Parameter(torch.randn(64))
    _, g, m, v = bufs()
    with pytest.raises(TypeError, match=r"param could not be exported through DLPack"):
        _C.adam_step(p, g, m, v, **KW)


def test_consumed_capsule():
    t = torch.randn(8)
    cap = t.__dlpack__()
    _C.Buffer(cap)
    with pytest.raises(TypeError, match="consumed only once"):
        _C.Buffer(cap)


def test_sgd_and_others_validate_too():
    p, g, m, _ = bufs()
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        _C.sgd_step(p, g, m, lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="momentum != 0 needs the momentum_buffer"):
        _C.sgd_step(p, g, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"beta2 must be in \[0, 1\)"):
        _C.lion_step(p, g, m, lr=1e-4, beta1=0.9, beta2=1.5)
    with pytest.raises(ValueError, match="lr_decay must be"):
        _C.adagrad_step(p, g, m, lr=0.1, lr_decay=-1.0, step=1)
    with pytest.raises(ValueError, match="grad_scale must be finite"):
        _C.lion_step(p, g, m, lr=1e-4, beta1=0.9, beta2=0.99, grad_scale=math.inf)


def test_amsgrad_needs_its_buffer():
    p, g, m, v = bufs()
    with pytest.raises(ValueError, match="amsgrad=True needs the max_exp_avg_sq"):
        _C.adam_step(p, g, m, v, amsgrad=True, **KW)


def test_cuda_tensor_where_cpu_is_needed():
    keep = []
    cap = fake_capsule(2, keep)
    _, g, m, v = bufs(16)
    with pytest.raises(ValueError, match="param is on cuda .* needs a CPU tensor"):
        _C.adam_step(cap, g, m, v, **KW)


def test_a_capsule_without_data_is_refused_by_name():
    """A DLPack producer's capsule of 64 CPU elements at address 0: the
    core added `start` to the pointer before its own check, and wrote near
    address 0 (C hunt: a segfault). Refused before anything runs."""
    from dlpack_fakes import CPU, Fakes
    fakes = Fakes()
    _, g, m, v = bufs(64)
    with pytest.raises(ValueError, match="param has 64 elements but no data"):
        _C.sgd_step(fakes(64, device_type=CPU, address=0), g, lr=0.1, start=8)
    with pytest.raises(ValueError, match="param has 64 elements but no data"):
        _C.adam_step(fakes(64, device_type=CPU, address=0), g, m, v, **KW)


def test_a_shape_whose_element_count_overflows_is_refused():
    """Dimensions of 2**62 + 1 and 4 multiply to 4 in int64: the capsule
    was taken as 4 elements (undefined behaviour in the count)."""
    import ctypes
    from dlpack_fakes import CPU, Fakes
    fakes = Fakes()
    capsule = fakes(4, device_type=CPU, address=fakes.address())
    managed = ctypes.cast(ctypes.pythonapi.PyCapsule_GetPointer(
        ctypes.py_object(capsule), b"dltensor"), ctypes.POINTER(ctypes.c_int64 * 8))
    shape = (ctypes.c_int64 * 2)(2 ** 62 + 1, 4)
    from dlpack_fakes import _DLManaged
    tensor = ctypes.cast(ctypes.addressof(managed.contents), ctypes.POINTER(_DLManaged))
    tensor.contents.dl_tensor.ndim = 2
    tensor.contents.dl_tensor.shape = shape
    _, g, _m, _v = bufs(4)
    with pytest.raises(ValueError, match="param has more elements than 64 bits count"):
        _C.sgd_step(capsule, g, lr=0.1)
    del shape


def test_set_simd_and_threads_errors():
    with pytest.raises(ValueError, match="name must be 'scalar', 'avx2' or 'avx512'"):
        _C.set_simd("sse9")
    with pytest.raises(ValueError, match=r"n \(the thread count\) must be between 0"):
        zero.set_num_threads(-2)
    with pytest.raises(TypeError, match=r"n \(the thread count\) must be an int, got str '4'"):
        zero.set_num_threads("4")


def test_python_optimizers_validate():
    p = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="lr must be a finite number >= 0, got -1"):
        zero.optim.AdamW(p, lr=-1)
    with pytest.raises(ValueError, match=r"beta1 must be in \[0, 1\), got 1.2"):
        zero.optim.Adam(p, betas=(1.2, 0.9))
    with pytest.raises(ValueError, match="capturable=True"):
        zero.optim.AdamW(p, capturable=True)
    with pytest.raises(TypeError, match="parameter 0 of param group 0 has dtype torch.float64"):
        zero.optim.SGD([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    q = torch.nn.Parameter(torch.randn(4))
    with pytest.warns(UserWarning, match="duplicate"):  # torch's own warning first
        with pytest.raises(ValueError, match="lists a parameter twice"):
            zero.optim.SGD([q, q])

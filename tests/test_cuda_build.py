"""The CUDA path on a machine without one: the extension says why it cannot
run, records whether the kernels were embedded, and every cuda_* binding
checks its arguments (by name) before it touches the driver. CUDA tensors
are DLPack capsules built by hand (dlpack_fakes); their addresses are never
dereferenced here."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero
from dlpack_fakes import CPU, Fakes
from zero import _C

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernels"))
import nvcc_build  # noqa: E402

AVAILABLE = _C.cuda_available()
# A call that passes every check launches kernels: never with fake memory.
no_cuda_here = pytest.mark.skipif(
    AVAILABLE, reason="CUDA works here: tests/gpu runs the kernels for real")
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@pytest.fixture
def fake():
    return Fakes()


def test_info_records_the_build():
    info = _C.cuda_info()
    assert set(info) == {"available", "reason", "fatbin_bytes", "archs", "build",
                         "driver_version"}
    assert info["available"] == AVAILABLE
    nvcc, why_not = nvcc_build.find_nvcc()
    if nvcc:  # the extension is built where it is tested (make test)
        assert info["fatbin_bytes"] > 10_000, (
            f"nvcc is at {nvcc} but the extension was built without it: rebuild")
        assert info["archs"] == ["sm_80", "sm_90", "compute_90"]
        assert info["build"].startswith("built with nvcc")
    else:
        assert info["fatbin_bytes"] == 0 and info["archs"] == []
        assert info["build"] == why_not


@no_cuda_here
def test_unavailable_says_why():
    info = _C.cuda_info()
    assert info["reason"]
    if info["fatbin_bytes"] == 0:
        assert "built without nvcc" in info["reason"]
    else:
        assert re.search(r"libcuda\.so\.1|cuInit|no device", info["reason"]), info["reason"]
    assert _C.cuda_info()["reason"] == info["reason"], "the answer is remembered"


def test_embed_without_nvcc(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_NO_CUDA", "1")
    c_file = nvcc_build.embed(tmp_path)
    text = c_file.read_text()
    assert "const size_t zero_fatbin_size = 0;" in text
    assert 'zero_fatbin_note[] = "built without nvcc: ZERO_NO_CUDA=1 was set";' in text
    subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", "-c", str(c_file), "-o",
                    str(tmp_path / "embed.o")], check=True)


@pytest.mark.skipif(not nvcc_build.find_nvcc()[0], reason="no nvcc here")
def test_embed_compiles_once(tmp_path):
    c_file = nvcc_build.embed(tmp_path)
    fatbin = tmp_path / "zero_kernels.fatbin"
    size = fatbin.stat().st_size
    assert f"const size_t zero_fatbin_size = {size};" in c_file.read_text()
    built_at = fatbin.stat().st_mtime_ns
    nvcc_build.embed(tmp_path)  # no input changed: no second nvcc run
    assert fatbin.stat().st_mtime_ns == built_at


def valid_calls(fake):
    """One call of each kernel binding with arguments that pass every
    check."""
    return {
        "cuda_adam_step": lambda: _C.cuda_adam_step(
            fake(), fake(16, "bfloat16"), fake(), fake(), fake(16, "bfloat16"),
            step=fake(1), found_inf=fake(1), **HP),
        "cuda_multi_tensor_adam": lambda: _C.cuda_multi_tensor_adam(
            [fake(3), fake(5)], [fake(3), fake(5, "float16")], [fake(3), fake(5)],
            [fake(3), fake(5)], [None, fake(5, "bfloat16")], step=fake(1), **HP),
        "cuda_l2_norm": lambda: _C.cuda_l2_norm(
            [fake(3), fake(40000, "bfloat16")], fake(1), fake(4), squared=True),
        "cuda_unscale_check": lambda: _C.cuda_unscale_check(
            [fake(3, "float16"), fake(9)], fake(1), scale=0.5),
        "cuda_pack": lambda: _C.cuda_pack([fake(3), fake(5)], fake(8, "bfloat16")),
        "cuda_unpack": lambda: _C.cuda_unpack(fake(16, "bfloat16"), [fake(3), fake(5)],
                                              offsets=[8, 0]),
    }


@no_cuda_here
@pytest.mark.parametrize("name", sorted(valid_calls(None)))
def test_valid_call_raises_runtime_error_naming_why(fake, name):
    reason = _C.cuda_info()["reason"]
    with pytest.raises(RuntimeError, match=f"^{name}: ") as caught:
        valid_calls(fake)[name]()
    assert str(caught.value) == f"{name}: {reason}"


def test_nothing_creates_a_cuda_context():
    """Import, the probes, a failing call and the Python wrapper leave torch's
    CUDA state untouched (tests/gpu checks the driver's primary context on a
    GPU machine)."""
    code = (
        "import torch, zero, zero.step._cuda\n"
        "from zero import _C\n"
        "_C.cuda_available(); _C.cuda_info()\n"
        "try:\n"
        "    zero.step._cuda.l2_norm([torch.ones(3)])\n"
        "except ValueError:\n"
        "    pass\n"
        "print(torch.cuda.is_initialized())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# (binding, arguments built from `fake`, exception, message): every check of
# every cuda_* binding, each with the name of the argument it refuses.
def adam(fake, **change):
    args = dict(param=fake(), grad=fake(), exp_avg=fake(), exp_avg_sq=fake(),
                step=fake(1), **HP)
    args.update(change)
    return _C.cuda_adam_step(**args)


def multi(fake, n=(3, 8, 5), **change):
    args = dict(params=[fake(k) for k in n], grads=[fake(k) for k in n],
                exp_avgs=[fake(k) for k in n], exp_avg_sqs=[fake(k) for k in n],
                step=fake(1), **HP)
    args.update(change)
    return _C.cuda_multi_tensor_adam(**args)


def norm(fake, **change):
    args = dict(tensors=[fake(3), fake(16384 + 1)], out=fake(1), partials=fake(3))
    args.update(change)
    return _C.cuda_l2_norm(**args)


def unscale(fake, **change):
    args = dict(tensors=[fake(3), fake(7, "bfloat16")], found_inf=fake(1), scale=0.5)
    args.update(change)
    return _C.cuda_unscale_check(**args)


def pack(fake, **change):
    args = dict(tensors=[fake(8), fake(8)], bucket=fake(16, "bfloat16"))
    args.update(change)
    return _C.cuda_pack(**args)


def unpack(fake, **change):
    args = dict(bucket=fake(16, "bfloat16"), tensors=[fake(8), fake(8)])
    args.update(change)
    return _C.cuda_unpack(**args)


def shared(fake, n=16):
    """Two capsules of the same memory (the second overlaps the first)."""
    at = fake.address()
    return fake(n, address=at), fake(n, address=at + 4 * (n // 2))


BAD_CALLS = [
    # cuda_adam_step
    ("cpu param", lambda f: adam(f, param=torch.ones(16)), ValueError,
     r"param is on cpu \(device type 1\); the cuda_\* functions need a CUDA tensor"),
    ("pinned is cpu", lambda f: adam(f, grad=f(16, device_type=3)), ValueError,
     r"grad is on cuda pinned host"),
    ("float64 grad", lambda f: adam(f, grad=f(16, "float64")), TypeError,
     r"grad has an unsupported dtype \(DLPack code 2, 64 bits"),
    ("bf16 state", lambda f: adam(f, exp_avg=f(16, "bfloat16")), TypeError,
     r"exp_avg must be float32, got bfloat16"),
    ("size", lambda f: adam(f, exp_avg_sq=f(15)), ValueError,
     r"exp_avg_sq has 15 elements, param has 16"),
    ("copy size", lambda f: adam(f, copy_out=f(17, "bfloat16")), ValueError,
     r"copy_out has 17 elements, param has 16"),
    ("int copy", lambda f: adam(f, copy_out=f(16, "int32")), TypeError,
     r"copy_out has an unsupported dtype"),
    ("device", lambda f: adam(f, grad=f(device_id=1)), ValueError,
     r"grad is on cuda:1, step on cuda:0; every tensor of a call must be on one device"),
    ("step size", lambda f: adam(f, step=f(2)), ValueError,
     r"step must have 1 element, it has 2"),
    ("step dtype", lambda f: adam(f, step=f(1, "int32")), TypeError,
     r"step has an unsupported dtype"),
    ("found_inf dtype", lambda f: adam(f, found_inf=f(1, "float16")), TypeError,
     r"found_inf must be float32, got float16"),
    ("found_inf size", lambda f: adam(f, found_inf=f(4)), ValueError,
     r"found_inf must have 1 element, it has 4"),
    ("no step", lambda f: _C.cuda_adam_step(f(), f(), f(), f(), **HP), TypeError,
     r"cuda_adam_step\(\) missing required keyword argument 'step'"),
    ("no lr", lambda f: _C.cuda_adam_step(f(), f(), f(), f(), step=f(1), beta1=0.9,
                                          beta2=0.9, eps=0.0, weight_decay=0.0),
     TypeError, r"missing required keyword argument 'lr'"),
    ("None param", lambda f: adam(f, param=None), TypeError,
     r"param must be a CUDA tensor, not None"),
    ("list param", lambda f: adam(f, param=[1.0]), TypeError,
     r"param must be a tensor \(an object with __dlpack__\) or a DLPack capsule, not list"),
    ("strided", lambda f: adam(f, param=f(16, stride=2)), ValueError,
     r"param is not contiguous"),
    ("misaligned", lambda f: adam(f, param=f(16, address=f.address() + 2)), ValueError,
     r"param starts at address .*, not aligned to its 4-byte elements"),
    ("overlap", lambda f: adam(f, **dict(zip(("param", "exp_avg"), shared(f)))), ValueError,
     r"(param and exp_avg|exp_avg and param) overlap in memory"),
    ("step in param", lambda f: (lambda a: adam(f, param=f(16, address=a),
                                                step=f(1, address=a + 60)))(f.address()),
     ValueError, r"overlap in memory"),
    ("lr", lambda f: adam(f, lr=-1.0), ValueError, r"lr must be a finite number >= 0"),
    ("beta2", lambda f: adam(f, beta2=1.0), ValueError, r"beta2 must be in \[0, 1\)"),
    ("grad_scale", lambda f: adam(f, grad_scale=float("nan")), ValueError,
     r"grad_scale must be finite"),
    ("stream", lambda f: adam(f, stream=-1), ValueError, r"stream must be a CUstream handle"),
    ("amsgrad", lambda f: adam(f, amsgrad=True), TypeError,
     r"'amsgrad' is an invalid keyword argument"),
    # cuda_multi_tensor_adam
    ("tensor as list", lambda f: multi(f, params=f(3)), TypeError,
     r"params must be a list or tuple of tensors, not PyCapsule"),
    ("lengths", lambda f: multi(f, grads=[f(3), f(8)]), ValueError,
     r"grads has 2 tensors, params has 3"),
    ("None as list", lambda f: multi(f, grads=None), TypeError,
     r"grads must be a list or tuple of tensors, not NoneType"),
    ("copy lengths", lambda f: multi(f, copy_outs=[None]), ValueError,
     r"copy_outs has 1 tensors, params has 3"),
    ("item size", lambda f: multi(f, exp_avgs=[f(3), f(7), f(5)]), ValueError,
     r"exp_avgs\[1\] has 7 elements, params\[1\] has 8"),
    ("item dtype", lambda f: multi(f, exp_avg_sqs=[f(3), f(8), f(5, "float16")]), TypeError,
     r"exp_avg_sqs\[2\] must be float32, got float16"),
    ("item None", lambda f: multi(f, grads=[f(3), None, f(5)]), TypeError,
     r"grads\[1\] must be a CUDA tensor, not None"),
    ("item cpu", lambda f: multi(f, grads=[f(3), f(8), f(5, device_type=CPU)]), ValueError,
     r"grads\[2\] is on cpu"),
    ("item device", lambda f: multi(f, params=[f(3), f(8, device_id=2), f(5)]), ValueError,
     r"params\[1\] is on cuda:2, step on cuda:0"),
    ("across items", lambda f: (lambda a, b: multi(
        f, n=(8, 8), params=[a, f(8)], copy_outs=[None, b]))(*shared(f, 8)),
     ValueError, r"(params\[0\] and copy_outs\[1\]|copy_outs\[1\] and params\[0\]) overlap"),
    # cuda_l2_norm
    ("partials", lambda f: norm(f, partials=f(2)), ValueError,
     r"partials has 2 elements; these tensors need 3 \(cuda_norm_partials\)"),
    ("out size", lambda f: norm(f, out=f(2)), ValueError, r"out must have 1 element, it has 2"),
    ("out dtype", lambda f: norm(f, out=f(1, "bfloat16")), TypeError,
     r"out must be float32, got bfloat16"),
    ("norm int", lambda f: norm(f, tensors=[f(3, "int32")]), TypeError,
     r"tensors\[0\] has an unsupported dtype"),
    ("norm cpu", lambda f: norm(f, tensors=[f(3), torch.ones(2)]), ValueError,
     r"tensors\[1\] is on cpu"),
    ("out in tensor", lambda f: (lambda a: norm(f, tensors=[f(16, address=a)],
                                                out=f(1, address=a + 8)))(f.address()),
     ValueError, r"overlap in memory"),
    ("norm stream", lambda f: norm(f, stream=-5), ValueError, r"stream must be"),
    # cuda_unscale_check
    ("no scale", lambda f: _C.cuda_unscale_check([f()], f(1)), TypeError,
     r"missing required keyword argument 'scale'"),
    ("scale", lambda f: unscale(f, scale=float("inf")), ValueError, r"scale must be finite"),
    ("flag size", lambda f: unscale(f, found_inf=f(3)), ValueError,
     r"found_inf must have 1 element"),
    ("flag device", lambda f: unscale(f, found_inf=f(1, device_id=1)), ValueError,
     r"tensors\[0\] is on cuda:0, found_inf on cuda:1"),
    ("aliased grads", lambda f: unscale(f, tensors=list(shared(f))), ValueError,
     r"tensors\[0\] and tensors\[1\]|tensors\[1\] and tensors\[0\]"),
    # cuda_pack / cuda_unpack
    ("does not fit", lambda f: pack(f, offsets=[0, 10]), ValueError,
     r"tensors\[1\] \(8 elements\) at offset 10 does not fit in bucket \(16 elements\)"),
    ("negative offset", lambda f: unpack(f, offsets=[-1, 0]), ValueError,
     r"tensors\[0\] \(8 elements\) at offset -1 does not fit"),
    ("too many", lambda f: pack(f, tensors=[f(8), f(9)]), ValueError,
     r"tensors\[1\] \(9 elements\) at offset 8 does not fit in bucket \(16 elements\)"),
    ("offsets length", lambda f: pack(f, offsets=[0]), ValueError,
     r"offsets has 1 entries, tensors has 2"),
    ("offsets type", lambda f: pack(f, offsets=5), TypeError,
     r"offsets must be a list or tuple of ints"),
    ("slices overlap", lambda f: pack(f, offsets=[0, 4]), ValueError,
     r"bucket\[\d+:\d+\] \(tensors\[\d\]\) and bucket\[\d+:\d+\] \(tensors\[\d\]\) overlap"),
    ("unpack into bucket", lambda f: (lambda a: unpack(
        f, bucket=f(16, address=a), tensors=[f(8, address=a + 32), f(8)]))(f.address()),
     ValueError, r"overlap in memory"),
    ("bucket dtype", lambda f: pack(f, bucket=f(16, "float64")), TypeError,
     r"bucket has an unsupported dtype"),
    ("bucket device", lambda f: unpack(f, bucket=f(16, device_id=3)), ValueError,
     r"tensors\[0\] is on cuda:0, bucket on cuda:3"),
    ("pack scale", lambda f: pack(f, scale=float("-inf")), ValueError, r"scale must be finite"),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_are_named(fake, case):
    _, call, error, message = case
    with pytest.raises(error, match=message):
        call(fake)


def test_every_binding_is_covered():
    called = set(re.findall(r"_C\.(cuda_\w+)", Path(__file__).read_text()))
    bindings = {name for name in dir(_C) if name.startswith("cuda_")}
    assert bindings <= called, bindings - called


def test_norm_partials():
    assert _C.cuda_norm_partials([1, 16384, 16385, 0]) == 4
    assert _C.cuda_norm_partials(()) == 0
    with pytest.raises(ValueError, match=r"numels\[1\] is negative: -2"):
        _C.cuda_norm_partials([3, -2])
    with pytest.raises(TypeError, match="numels must be a list or tuple"):
        _C.cuda_norm_partials(3)


@pytest.mark.parametrize("call", [
    lambda cap: _C.sum_squares(cap),
    lambda cap: _C.all_finite(cap),
    lambda cap: _C.convert(torch.ones(16), cap),
    lambda cap: _C.lion_step(torch.ones(16), cap, torch.ones(16), lr=0.1, beta1=0.9,
                             beta2=0.99),
], ids=["sum_squares", "all_finite", "convert", "lion_step"])
def test_cpu_functions_refuse_cuda_tensors(fake, call):
    with pytest.raises(ValueError, match=r"is on cuda \(device type 2\); this operation "
                                         r"needs a CPU tensor"):
        call(fake())


def test_buffer_holds_a_cuda_tensor_for_the_cuda_functions_only(fake):
    cuda_buffer = _C.Buffer(fake(16, "bfloat16", device_id=1))
    assert (cuda_buffer.device, cuda_buffer.numel, cuda_buffer.dtype) == ("cuda:1", 16, "bfloat16")
    assert "on cuda:1" in repr(cuda_buffer)
    with pytest.raises(ValueError, match=r"tensor is on cuda .* needs a CPU tensor"):
        _C.sum_squares(cuda_buffer)
    cpu_buffer = _C.Buffer(torch.ones(16))
    assert cpu_buffer.device == "cpu"
    with pytest.raises(ValueError, match=r"param is on cpu .* need a CUDA tensor"):
        adam(fake, param=cpu_buffer)
    # a Buffer is checked again, not consumed: the same one serves twice
    for _ in range(2):
        with pytest.raises(ValueError, match=r"grad is on cuda:1, step on cuda:0"):
            adam(fake, grad=cuda_buffer)


def test_wrapper_needs_cuda_tensors():
    from zero.step import _cuda
    with pytest.raises(ValueError, match=r"tensors\[0\] is on cpu; zero\._cuda needs CUDA"):
        _cuda.l2_norm([torch.ones(3)])
    with pytest.raises(ValueError, match=r"param is on cpu; zero\._cuda needs CUDA"):
        _cuda.adam_step(torch.ones(3), torch.ones(3), torch.ones(3), torch.ones(3),
                        step=torch.zeros(1), lr=1e-3)
    assert _cuda.available() == AVAILABLE
    assert not torch.cuda.is_initialized()

"""Where tests/gpu run: on a GPU, or, with ZERO_TEST_EMULATED_CUDA=1 (set by
tests/test_cuda_emulated.py), on the CPU through the emulated driver, with
CPU tensors standing in for CUDA tensors. SKIP_REASON is set when neither
can run; each test module skips on it."""
import os

import pytest
import torch

from zero import _C
from zero.step import _cuda

EMULATED = os.environ.get("ZERO_TEST_EMULATED_CUDA") == "1"
SKIP_REASON = None
if EMULATED:
    DEVICE = torch.device("cpu")
elif not torch.cuda.is_available():
    DEVICE = None
    SKIP_REASON = "no GPU here: torch.cuda.is_available() is False"
elif _C.cuda_info()["fatbin_bytes"] == 0:
    DEVICE = None
    SKIP_REASON = f"zero was {_C.cuda_info()['build']}"
else:
    DEVICE = torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(autouse=True)
def device_path(monkeypatch):
    """On a GPU: the kernels must be available. Emulated: CPU tensors go to
    the binding as CUDA tensors of the emulated driver."""
    if EMULATED:
        from dlpack_fakes import as_cuda_capsule
        monkeypatch.setattr(_cuda, "_plain",
                            lambda t: None if t is None else as_cuda_capsule(t.detach()))
        monkeypatch.setattr(_cuda, "_stream_for", lambda t, name: 0)
    else:
        assert _C.cuda_available(), _C.cuda_info()["reason"]

"""deepspeed.OnDevice (also deepspeed.utils.OnDevice): build a model's
tensors on a device and in a floating dtype, `with OnDevice(dtype=
torch.bfloat16, device="meta"): model = Model(config)`.

As DeepSpeed's, it reaches the tensors made by torch.empty, torch.zeros,
torch.ones and torch.full only (what nn.Linear, nn.Embedding and their
kind make their parameters with): those made without a device go to
`device`, and floating ones become `dtype`. Other factories (torch.tensor,
torch.arange) are left alone, so a table a model computes in __init__
(rotary frequencies, a causal mask) is real and in its own dtype, as under
DeepSpeed; a torch.device context would have put it on the meta device,
values lost. Done with a torch function mode, so nothing of torch's is
replaced and an exception inside leaves nothing behind."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full}


class _Factories(TorchFunctionMode):
    def __init__(self, device, dtype):
        super().__init__()
        self.device, self.dtype = device, dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in _FACTORIES:
            return func(*args, **kwargs)
        if kwargs.get("device") is None:
            kwargs["device"] = self.device
        made = func(*args, **kwargs)
        if self.dtype is not None and made.is_floating_point() and made.dtype != self.dtype:
            made = made.to(self.dtype)
        return made


class OnDevice:
    def __init__(self, dtype, device="meta", enabled=True):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"OnDevice: dtype must be a floating torch.dtype (torch.bfloat16, "
                            f"torch.float16, ...) or None, got {dtype!r}")
        self.dtype, self.device, self.enabled = dtype, device, enabled
        self._mode = None

    def __enter__(self):
        if self.enabled:
            self._mode = _Factories(torch.device(self.device), self.dtype)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)
        return False

"""deepspeed.OnDevice (also deepspeed.utils.OnDevice): build a model's
tensors on a device and in a floating dtype, `with OnDevice(dtype=
torch.bfloat16, device="meta"): model = Model(config)`. Here through
torch's own switches, the default device (torch.device as a context) and
the default floating dtype (torch.set_default_dtype), both put back on
exit. As under DeepSpeed the dtype applies to floating tensors made
without one and the device to tensors made without one; the default
dtype is process-wide while inside, as DeepSpeed's patched constructors
are."""
from __future__ import annotations

import torch


class OnDevice:
    def __init__(self, dtype, device="meta", enabled=True):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"OnDevice: dtype must be a floating torch.dtype (torch.bfloat16, "
                            f"torch.float16, ...) or None, got {dtype!r}")
        self.dtype, self.device, self.enabled = dtype, device, enabled
        self._device_context = None
        self._dtype_before = None

    def __enter__(self):
        if not self.enabled:
            return self
        self._device_context = torch.device(self.device)
        self._device_context.__enter__()
        if self.dtype is not None:
            self._dtype_before = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        if self._dtype_before is not None:
            torch.set_default_dtype(self._dtype_before)
            self._dtype_before = None
        context, self._device_context = self._device_context, None
        context.__exit__(*exc)
        return False

"""deepspeed.accelerator.get_accelerator(): the device calls training
scripts make, answered by torch for CUDA, or for the CPU where no GPU is."""
from __future__ import annotations

import torch


class _Accelerator:
    """DeepSpeed's accelerator interface, the part scripts use."""

    def __init__(self):
        self._cuda = torch.cuda.is_available()

    def device_name(self, device_index=None) -> str:
        name = "cuda" if self._cuda else "cpu"
        return name if device_index is None or not self._cuda else f"{name}:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index):
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index=None):
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def manual_seed(self, seed):
        if self._cuda:
            torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed):
        if self._cuda:
            torch.cuda.manual_seed_all(seed)

    def empty_cache(self):
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index=None):
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == ("cuda" if self._cuda else "cpu")

    def Stream(self, *args, **kwargs):  # noqa: N802 (DeepSpeed's name)
        if not self._cuda:
            raise RuntimeError("get_accelerator().Stream: no CUDA device here")
        return torch.cuda.Stream(*args, **kwargs)

    def __repr__(self):
        return f"zero accelerator ({self.device_name()})"


_ACCELERATOR = None


def get_accelerator() -> _Accelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = _Accelerator()
    return _ACCELERATOR

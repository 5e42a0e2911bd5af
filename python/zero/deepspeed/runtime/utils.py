"""deepspeed.runtime.utils: the helpers training scripts import from it
(Megatron-DeepSpeed's and many others' see_memory_usage between phases;
get_global_norm and clip_grad_norm_)."""
from __future__ import annotations

import gc
import math
import os

import torch

from zero.deepspeed.accelerator import get_accelerator
from zero.engine._generation import available_memory

_GB = 1024 ** 3


def see_memory_usage(message, force=False):
    """With force=True, print (rank 0; to stdout, as DeepSpeed 0.19.8's
    print(), not its logger) the message, the device's allocated and
    reserved memory with their peaks, and the host's used memory, in
    DeepSpeed's lines; then reset the device's peaks. Without force:
    nothing, as DeepSpeed does."""
    if not force:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_rank() != 0:
        return
    gc.collect()
    accelerator = get_accelerator()
    cuda = torch.cuda.is_available()
    reserved = torch.cuda.memory_reserved() if cuda else 0
    max_reserved = torch.cuda.max_memory_reserved() if cuda else 0
    print(message)
    print(f"MA {round(accelerator.memory_allocated() / _GB, 2)} GB "
                f"Max_MA {round(accelerator.max_memory_allocated() / _GB, 2)} GB "
                f"CA {round(reserved / _GB, 2)} GB Max_CA {round(max_reserved / _GB)} GB ")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    used = total - available_memory(torch.device("cpu"))
    print(f"CPU Virtual Memory:  used = {round(used / _GB, 2)} GB, "
                f"percent = {round(100 * used / total, 1)}%")
    accelerator.reset_peak_memory_stats()


def get_global_norm(norm_list):
    """The norm of norms: sqrt(sum of their squares)."""
    return math.sqrt(sum(float(norm) ** 2 for norm in norm_list))


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None):
    """torch.nn.utils.clip_grad_norm_ over the parameters' .grad, the norm
    returned as a float. mpu (a model-parallel unit, whose ranks' norms
    DeepSpeed's sums) is refused: under zero's engine, gradient_clipping in
    the config clips across every rank and partition."""
    if mpu is not None:
        raise NotImplementedError("clip_grad_norm_(mpu=...): the norm across model-parallel "
                                  "ranks is not summed here; set gradient_clipping in the "
                                  "config, which the engine applies across every rank")
    return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type))


__all__ = ["see_memory_usage", "get_global_norm", "clip_grad_norm_"]

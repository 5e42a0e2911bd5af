"""deepspeed.checkpointing: activation checkpointing with DeepSpeed's
calls, on torch.utils.checkpoint (non-reentrant, which stage 3's hooks
follow; it keeps each device's random state for the recomputation, so
dropout under tensor parallelism recomputes the same masks). A Megatron
mpu is taken (configure(mpu, ...), as Megatron-DeepSpeed's scripts call
it): each rank checkpoints its own activations. Partitioning activations
across the model-parallel ranks, contiguous buffers and keeping them on
the CPU are refused: torch's save_on_cpu is the way to the last."""
from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint

_configured = {"done": False}


def configure(mpu_, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None):
    """mpu_: a Megatron mpu or None (each rank checkpoints its own
    activations either way)."""
    if partition_activations or checkpoint_in_cpu or contiguous_checkpointing:
        raise NotImplementedError(
            "deepspeed.checkpointing: partition_activations, contiguous_checkpointing and "
            "checkpoint_in_cpu are not supported (each rank keeps its own checkpointed "
            "inputs whole; for activations on the CPU use "
            "torch.autograd.graph.save_on_cpu)")
    _configured["done"] = True


def is_configured() -> bool:
    return _configured["done"]


def checkpoint(function, *args, **kwargs):
    """function(*args, **kwargs), its activations recomputed in backward.
    Keyword arguments reach the function as DeepSpeed's do (torch's
    non-reentrant checkpoint follows tensors however they arrive, so a
    keyword tensor gets its gradient too); none is taken for torch's own
    checkpoint options."""
    if kwargs:
        return _torch_checkpoint.checkpoint(lambda *a: function(*a, **kwargs), *args,
                                            use_reentrant=False)
    return _torch_checkpoint.checkpoint(function, *args, use_reentrant=False)


# DeepSpeed's name for its non-reentrant variant; checkpoint() above is one
non_reentrant_checkpoint = checkpoint

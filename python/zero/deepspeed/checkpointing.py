"""deepspeed.checkpointing: activation checkpointing with DeepSpeed's
calls, on torch.utils.checkpoint (non-reentrant, which stage 3's hooks
follow). Partitioning activations across model-parallel ranks and keeping
them on the CPU are refused: zero has no model parallelism yet, and
torch's save_on_cpu is the way to the second."""
from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint

_configured = {"done": False}


def configure(mpu_, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None):
    if mpu_ is not None:
        raise NotImplementedError("deepspeed.checkpointing.configure(mpu_): model "
                                  "parallelism is not supported yet; pass None")
    if partition_activations or checkpoint_in_cpu or contiguous_checkpointing:
        raise NotImplementedError(
            "deepspeed.checkpointing: partition_activations, contiguous_checkpointing and "
            "checkpoint_in_cpu are not supported (no model parallelism to partition over; for "
            "activations on the CPU use torch.autograd.graph.save_on_cpu)")
    _configured["done"] = True


def is_configured() -> bool:
    return _configured["done"]


def checkpoint(function, *args):
    """function(*args), its activations recomputed in backward."""
    return _torch_checkpoint.checkpoint(function, *args, use_reentrant=False)

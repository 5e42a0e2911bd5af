"""deepspeed.runtime.activation_checkpointing.checkpointing: the module
deepspeed.checkpointing names (Megatron-DeepSpeed imports it by this
path); the same functions."""
from zero.deepspeed.checkpointing import (checkpoint, configure, is_configured,  # noqa: F401
                                          non_reentrant_checkpoint)

__all__ = ["checkpoint", "non_reentrant_checkpoint", "configure", "is_configured"]

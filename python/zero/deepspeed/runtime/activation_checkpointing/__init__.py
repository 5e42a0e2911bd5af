"""deepspeed.runtime.activation_checkpointing: see checkpointing."""
from zero.deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]

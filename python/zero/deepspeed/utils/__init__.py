"""deepspeed.utils: zero_to_fp32's functions over zero's checkpoints."""
from zero.deepspeed.utils import zero_to_fp32

__all__ = ["zero_to_fp32"]

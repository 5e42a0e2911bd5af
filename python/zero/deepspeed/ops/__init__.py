"""deepspeed.ops: the optimizers DeepSpeed scripts build themselves
(`from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam`)."""
from zero.deepspeed.ops import adam

__all__ = ["adam"]

"""deepspeed.runtime.zero.config's ZeroStageEnum: the stages by name, as
scripts compare a config's stage (`stage == ZeroStageEnum.weights`)."""
from enum import Enum


class ZeroStageEnum(int, Enum):
    """DeepSpeed's names of the ZeRO stages (max_stage is weights' alias)."""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


__all__ = ["ZeroStageEnum"]

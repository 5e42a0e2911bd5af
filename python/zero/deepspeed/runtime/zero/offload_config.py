"""deepspeed.runtime.zero.offload_config's OffloadDeviceEnum: the places an
offload block names."""
from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's offload devices; equal to the strings a config holds."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


__all__ = ["OffloadDeviceEnum"]

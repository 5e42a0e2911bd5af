"""zero.config: the settings an engine is built from (Config and its blocks,
keyword arguments or a DeepSpeed JSON config) and the LR schedules a
DeepSpeed config names."""
from zero.config._config import (Config, LossScaling, OffloadOptimizer, OffloadParam,
                                 check_nvme_path)

__all__ = ["Config", "LossScaling", "OffloadOptimizer", "OffloadParam", "check_nvme_path"]

"""deepspeed.runtime: the module paths scripts written for DeepSpeed import
names from (runtime.zero.partition_parameters, runtime.lr_schedules,
runtime.utils, runtime.engine, runtime.dataloader)."""
from zero.deepspeed.runtime import dataloader, engine, lr_schedules, utils, zero

__all__ = ["dataloader", "engine", "lr_schedules", "utils", "zero"]

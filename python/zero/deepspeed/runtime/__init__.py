"""deepspeed.runtime: the module paths scripts written for DeepSpeed import
names from (runtime.zero.partition_parameters, runtime.lr_schedules,
runtime.utils, runtime.engine, runtime.dataloader, runtime.compiler,
runtime.activation_checkpointing.checkpointing, runtime.zero.config and
offload_config, runtime.zero.stage3 and stage_1_and_2's estimates)."""
from zero.deepspeed.runtime import (activation_checkpointing, compiler, dataloader, engine,
                                    lr_schedules, utils, zero)

__all__ = ["activation_checkpointing", "compiler", "dataloader", "engine", "lr_schedules",
           "utils", "zero"]

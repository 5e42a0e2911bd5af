"""DeepSpeed's training-script API on zero's engine: `import zero.deepspeed
as deepspeed` and a script written for DeepSpeed runs with that line
changed (docs/deepspeed.md lists what is the same, what differs and what
is refused). Nothing here imports DeepSpeed."""
from zero.deepspeed import accelerator, checkpointing, comm, utils, zero
from zero.deepspeed._arguments import add_config_arguments
from zero.deepspeed._distributed import init_distributed
from zero.deepspeed._initialize import initialize
from zero.deepspeed.utils import OnDevice, log_dist, logger

__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "accelerator",
           "checkpointing", "comm", "utils", "OnDevice", "log_dist", "logger"]

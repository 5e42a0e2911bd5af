"""DeepSpeed's training-script API on zero's engine: `import zero.deepspeed
as deepspeed` and a script written for DeepSpeed runs with that line
changed (docs/deepspeed.md lists what is the same, what differs and what
is refused). Nothing here imports DeepSpeed."""
from zero.deepspeed import accelerator, checkpointing, comm, ops, runtime, utils, zero
from zero.deepspeed._arguments import add_config_arguments
from zero.deepspeed._distributed import init_distributed
from zero.deepspeed._inference import init_inference
from zero.deepspeed.accelerator import get_accelerator
from zero.deepspeed._initialize import initialize
from zero.deepspeed.runtime.compiler import is_compile_supported
from zero.deepspeed.runtime.engine import DeepSpeedEngine
from zero.deepspeed.utils import OnDevice, log_dist, logger

# the DeepSpeed release whose API this mirrors (scripts gate on it; zero's
# own version is zero.__version__)
__version__ = "0.19.8"
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8

__all__ = ["initialize", "init_inference", "init_distributed", "add_config_arguments", "zero", "accelerator",
           "checkpointing", "comm", "ops", "runtime", "utils", "OnDevice", "log_dist", "logger",
           "DeepSpeedEngine", "is_compile_supported", "get_accelerator", "__version__"]

"""zero: a ZeRO training engine for PyTorch with a plain-C core.

    engine = zero.initialize(model, optimizer=opt, stage=2, precision="bf16")

Importing zero creates no CUDA context and needs no GPU: the C core
(zero._C) is CPU code with its SIMD path chosen at run time.
"""
from zero import _C, checkpoint, optim
from zero._C import cpu_info, get_num_threads
from zero._estimate import estimate_memory
from zero._gathered import GatheredParameters
from zero._initialize import initialize
from zero._partitioned_init import partitioned_init
from zero._threads import set_num_threads
from zero.config import Config, LossScaling
from zero.engine import Engine

__all__ = ["initialize", "estimate_memory", "Engine", "Config", "LossScaling",
           "GatheredParameters",
           "partitioned_init", "optim", "checkpoint", "cpu_info", "get_num_threads", "set_num_threads"]
__version__ = "0.1.0"

"""zero: a ZeRO training engine for PyTorch with a plain-C core.

    engine = zero.initialize(model, optimizer=opt, stage=2, precision="bf16")

Importing zero creates no CUDA context and needs no GPU: the C core
(zero._C) is CPU code with its SIMD path chosen at run time.
"""
from zero import checkpoint, optim, parallel, rlhf
from zero._C import cpu_info, get_num_threads
from zero._version import __version__
from zero.engine._estimate import estimate_memory
from zero.engine._fit import settings_that_fit
from zero.sharding._gathered import GatheredParameters
from zero.engine._initialize import inference, initialize
from zero.sharding._partitioned_init import partitioned_init
from zero.step._threads import set_num_threads
from zero.config._config import Config, LossScaling
from zero.engine._engine import Engine

__all__ = ["initialize", "inference", "estimate_memory", "settings_that_fit", "Engine", "Config", "LossScaling",
           "GatheredParameters",
           "partitioned_init", "optim", "checkpoint", "parallel", "rlhf", "cpu_info", "get_num_threads", "set_num_threads"]


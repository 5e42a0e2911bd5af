"""zero: a ZeRO training engine for PyTorch with a plain-C core.

    engine = zero.initialize(model, optimizer=opt, stage=2, precision="bf16")

Importing zero creates no CUDA context and needs no GPU: the C core
(zero._C) is CPU code with its SIMD path chosen at run time.
"""
from zero import _C, optim
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


def __getattr__(name):
    # zero.checkpoint is imported on first use, so that `python -m
    # zero.checkpoint` runs the module once, as __main__ (imported here as
    # well, runpy warns that it would run a second copy)
    if name == "checkpoint":
        import importlib
        return importlib.import_module("zero.checkpoint")
    raise AttributeError(f"module 'zero' has no attribute {name!r}")

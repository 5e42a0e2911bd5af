"""zero: a ZeRO training engine for PyTorch with a plain-C core.

Importing zero creates no CUDA context and needs no GPU: the C core
(zero._C) is CPU code with its SIMD path chosen at run time.
"""
from zero import _C, optim
from zero._C import cpu_info, get_num_threads, set_num_threads

__all__ = ["optim", "cpu_info", "get_num_threads", "set_num_threads"]
__version__ = "0.1.0"

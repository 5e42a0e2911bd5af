"""zero.optim: CPU optimizers over flat buffers, run by the C core.

Drop-in for torch.optim's classes of the same names (same constructor
arguments and defaults, state dicts of the same layout), plus Lion.
"""
from zero.optim.adagrad import Adagrad
from zero.optim.adam import Adam, AdamW
from zero.optim.lion import Lion
from zero.optim.sgd import SGD

__all__ = ["Adam", "AdamW", "SGD", "Lion", "Adagrad"]

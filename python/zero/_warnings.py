"""Warnings attributed to the user's line.

The same warning is reached through zero.initialize, zero.deepspeed's
initialize, Config.from_deepspeed, ZeroTrainer or torch's own recursion
(state_dict), each at another depth, so no fixed stacklevel names the
caller: one pointed inside zero or torch, and Python's default filters,
which show a DeprecationWarning only where __main__ triggers it, hid it.
warn_user walks out of zero's and torch's frames first (Python 3.12's
skip_file_prefixes, by hand for 3.11)."""
from __future__ import annotations

import os
import sys
import warnings

import torch

_INSIDE = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                for m in (sys.modules[__package__], torch))


def warn_user(message: str, category=UserWarning) -> None:
    frame, level = sys._getframe(1), 2  # level 2: warn_user's caller
    while frame is not None and (frame.f_code.co_filename.startswith(_INSIDE) or
                                 frame.f_code.co_filename.startswith("<frozen")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)

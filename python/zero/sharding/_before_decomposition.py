"""The ops partitioned_init must see before torch decomposes them.

A placeholder parameter has stride 0 in every dimension (its storage is
one element, [Note: partitioned construction]). Most ops reach the
dispatch mode whole, and run there on the full values. A few are
decomposed first, in C++, into ops built from the tensor's strides:
`fill_diagonal_` takes an `as_strided` view whose stride is the sum of the
placeholder's strides, 0, so it wrote the first element over and over and
the rest of the diagonal kept its old values, silently. A TorchFunctionMode
sees the call before that: such an op on a placeholder runs on the full
values, as the dispatch mode runs the others."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods torch decomposes through the tensor's strides before any
# dispatch mode sees them
_DECOMPOSED_BY_STRIDES = {torch.Tensor.fill_diagonal_}


class BeforeDecomposition(TorchFunctionMode):
    def __init__(self, init):
        """init: the partitioned_init context (its _tracked and _resolve)."""
        super().__init__()
        self.init = init

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DECOMPOSED_BY_STRIDES and args:
            target = args[0]
            found = self.init._tracked(target)
            # with grad on, a parameter written in place raises in torch's
            # own path (a leaf that requires grad): left to it
            if found is not None and not (torch.is_grad_enabled() and target.requires_grad):
                real = self.init._resolve(target, found[1].base, False)
                func(real, *args[1:], **kwargs)
                return target
        return func(*args, **kwargs)

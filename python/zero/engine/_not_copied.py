"""copy.deepcopy, pickle and torch.save of an engine: refused with what to
copy instead. They failed on the C core's objects (cannot pickle
'zero._C.BucketHook', a lambda of the optimizer's spec), an error that
named neither the engine nor the way out. A mixin of Engine."""
from __future__ import annotations


class NotCopied:
    def _refuse_copy(self):
        raise TypeError(
            "a zero engine is not copied (copy.deepcopy, pickle, torch.save): copy its model, "
            "engine.module (at stage 3 inside zero.GatheredParameters(list("
            "engine.module.parameters())), where its parameters are whole), or save a "
            "checkpoint with engine.save_checkpoint")

    def __deepcopy__(self, memo):
        self._refuse_copy()

    def __reduce_ex__(self, protocol):
        self._refuse_copy()

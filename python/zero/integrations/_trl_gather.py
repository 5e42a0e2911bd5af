"""TRL's fused LM-head losses on a stage-3 model.

[Note: TRL's fused head] TRL 1.16 computes its trainers' log-probabilities
(DPO, KTO, GRPO, RLOO, SFT's token statistics) through a fused LM head: the
model's patched forward reads `lm_head.weight` directly and hands it to a
chunked autograd Function, never calling the `lm_head` module. At stage 3
the weight is then a released placeholder (its unit gathers around the
module's forward only): the Function saw a vocabulary of 0 and its
backward failed ("returned an invalid gradient at index 1 - got [0]").
TRL wraps those reads in `maybe_gather_lm_head_ctx(weight, bias)`, which
gathers for DeepSpeed's ZeRO-3 alone. `teach_trl_to_gather()` replaces it,
in the TRL modules that hold it, with one that gathers the parameters of
a zero engine with zero.GatheredParameters (a collective: every rank
computes the same loss) when one of them is released, and hands any other
parameters to TRL's own. The backward then finds the weight gathered
again through stage 3's saved-tensor hook ([Note: saved parameters]).
"""
from __future__ import annotations

import contextlib
import sys

from zero.sharding._gathered import GatheredParameters

# the TRL modules that call maybe_gather_lm_head_ctx, by the name they hold
# it under (chunked_divergence imported it at its own import)
_HOLDERS = ("trl.trainer.utils", "trl.kernels.chunked_divergence")


def teach_trl_to_gather():
    """Install the zero-aware maybe_gather_lm_head_ctx in the TRL modules
    imported so far (once; nothing when TRL is not imported)."""
    for name in _HOLDERS:
        module = sys.modules.get(name)
        original = getattr(module, "maybe_gather_lm_head_ctx", None)
        if original is None or getattr(original, "_zero_aware", False):
            continue
        module.maybe_gather_lm_head_ctx = _aware_of_zero(original)


def _aware_of_zero(trls):
    def maybe_gather_lm_head_ctx(*params):
        ours = {id(p): p for p in params
                if p is not None and getattr(p, "_zero_place", None) is not None}
        if not ours:
            return trls(*params)
        if all(p._zero_place.unit.gathered or p._zero_place.unit.persistent
               for p in ours.values()):
            return contextlib.nullcontext()
        return GatheredParameters(list(ours.values()))
    maybe_gather_lm_head_ctx._zero_aware = True
    maybe_gather_lm_head_ctx.__doc__ = trls.__doc__
    return maybe_gather_lm_head_ctx

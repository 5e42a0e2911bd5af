"""Gradient clipping's coefficient, as torch's clip_grad_norm_ computes it,
folded by the engine into the update's grad_scale (no pass of its own)."""
from __future__ import annotations

import math


def clip_coefficient(max_norm, norm) -> float:
    """What the gradients are multiplied by: torch's clip_grad_norm_
    coefficient min(1, max_norm / (norm + 1e-6)), 0 for an inf norm. For
    a NaN norm torch's is NaN, which turns every parameter NaN; the C core
    refuses a NaN scale, so it is 0 as for inf: the NaN elements' own
    parameters become NaN, the other gradients count for nothing that
    step (min() in Python would have given 1.0). docs/engine.md."""
    if not max_norm:
        return 1.0
    if math.isnan(norm):
        return 0.0
    return min(1.0, max_norm / (norm + 1e-6))

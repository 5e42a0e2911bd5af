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


def tensor_parallel_sumsq(sumsq, groups, tensor_parallel, comm, across_ranks) -> float:
    """The squared global norm of a tensor-parallel model's gradients from
    this rank's `sumsq` (already summed over the data-parallel ranks): a
    sharded parameter's pieces differ on each tp rank and all count; a
    replicated one (a LayerNorm, Replicate(), a parameter outside the
    plan) is the same on each and counts once. So each tp rank weighs its
    replicated part by 1/tp before the sum over tp, which keeps the global
    norm torch's on the unsplit model."""
    if tensor_parallel.world == 1:
        return sumsq
    replicated = 0.0
    for fg in groups:
        for name, _lo, _hi, offset in fg.owned_pieces():
            if not tensor_parallel.is_sharded(name):
                piece = fg.grad_part[offset:offset + _hi - _lo]
                replicated += float(piece.double().square().sum())
    if across_ranks:
        replicated = comm.sum_scalar(replicated)
    weighted = sumsq - replicated * (1.0 - 1.0 / tensor_parallel.world)
    return tensor_parallel.comm.sum_scalar(weighted)

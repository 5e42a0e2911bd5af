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


def model_parallel_sumsq(sumsq, groups, comm, across_ranks, tensor_parallel=None,
                        pipeline=None) -> float:
    """The squared global norm of a tensor- or pipeline-parallel model's
    gradients from this rank's `sumsq` (already summed over the data-
    parallel ranks). A parameter that lives on several model-parallel
    ranks at once counts once: a replicated one under tp (a LayerNorm,
    Replicate(), one outside the plan) is the same on each tp rank, a
    head tied to the embedding lives on the first and the last pipeline
    stage. So each rank weighs such a parameter by 1 / its copies before
    the sums over tp and over pp, which keeps the norm torch's on the
    unsplit model."""
    tp_world = tensor_parallel.world if tensor_parallel is not None else 1
    pp_world = pipeline.count if pipeline is not None else 1
    if tp_world == 1 and pp_world == 1:
        return sumsq

    def copies(name):
        shared = tp_world if not tensor_parallel or not tensor_parallel.is_sharded(name) else 1
        return shared * (pipeline.copies(name) if pipeline is not None else 1)
    extra = 0.0
    for fg in groups:
        for name, lo, hi, offset in fg.owned_pieces():
            n = copies(name)
            if n > 1:
                piece = fg.grad_part[offset:offset + hi - lo]
                extra += float(piece.double().square().sum()) * (1.0 - 1.0 / n)
    if across_ranks:
        extra = comm.sum_scalar(extra)
    weighted = sumsq - extra
    if tp_world > 1:
        weighted = tensor_parallel.comm.sum_scalar(weighted)
    if pp_world > 1:
        weighted = pipeline.comm.sum_scalar(weighted)
    return weighted

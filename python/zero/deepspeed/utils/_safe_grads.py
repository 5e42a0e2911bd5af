"""deepspeed.utils' readers and writers of one parameter's gradient:
safe_get_full_grad, safe_set_full_grad (the whole gradient, on every
rank) and safe_get_local_grad, safe_set_local_grad (this rank's elements,
flat, laid out as safe_get_local_fp32_param's).

[Note: safe gradients] The engine keeps gradients as sums: at stages 0-1
each rank's own sum until the boundary reduces them, at stages 2-3 this
rank's partition summed over its shard group during the backward (and
over the replicas at the boundary), with the fp16 loss scale in, and the
step divides by loss scale x data-parallel ranks x micro-batches
(docs/engine.md, "Averaging"). These calls give and take the gradient the
next step applies before clipping: averaged over the data-parallel ranks
and the micro-batches so far (divided by gradient_accumulation_steps, as
DeepSpeed's scaled losses leave it), without the loss scale, in fp32, on
the parameter's device. DeepSpeed 0.19.8's gave the same values (run on
this CPU beside zero: 2 ranks, 2 micro-batches, stages 0-3, fp32 equal to
the last bit, bf16 stages 2-3 too, bf16 stages 0-1 within rounding, its
gradients there being bf16); fp16, which it does not run on a CPU, was not
compared: here the loss scale is divided out. They are collectives where
the engine spans ranks (a parameter's pieces summed over the partitions'
group, the stage 0-1 sums reduced into a copy, on the model's device);
nothing is reduced in place, so the step still reduces as it would.
Written values replace what the backwards left for the next step, before
clip_grad_norm_ takes the norm the step clips by (after it, a write is
refused on every rank). A pipeline stage's tied copy (parallel/
_pipeline.py) reads and writes its own stage's share: the stages' shares
are summed at the boundary. A parameter no engine trains gives None and
is left alone."""
from __future__ import annotations

import torch

from zero.deepspeed.utils._safe_access import located, param_whole
from zero.deepspeed.utils._safe_writes import located_local, located_whole


def safe_get_full_grad(param):
    """The parameter's gradient as the next step applies it (averaged,
    unscaled, fp32), whole, on every rank; None where no engine trains it."""
    found = located(param, "safe_get_full_grad")
    if found is None:
        return None
    fg, unit, j = found
    return _averaged_whole(fg, unit, j).view(unit.shapes[j])


def safe_get_local_grad(param):
    """This rank's elements of safe_get_full_grad(param), flat."""
    found = located(param, "safe_get_local_grad")
    if found is None:
        return None
    fg, unit, j = found
    lo, hi, _span = fg.partition_span(unit, j)
    whole = _averaged_whole(fg, unit, j)
    off = unit.offsets[j]
    return whole[max(lo, off) - off:max(hi, lo) - off].clone()


def safe_set_full_grad(param, value):
    """Make `value` (the whole gradient, the same on every rank, as
    safe_get_full_grad gives it) the gradient the next step applies."""
    call = "safe_set_full_grad"
    found = located_whole(param, value, call,
                          lambda fg, unit, j: _refuse_after_reduction(unit, j, call))
    if found is None:
        return
    fg, unit, j, whole = found
    _store(fg, unit, j, whole)


def safe_set_local_grad(param, value):
    """Make `value` this rank's elements of the gradient the next step
    applies (flat, as safe_get_local_grad gives them)."""
    call = "safe_set_local_grad"
    found = located_local(param, value, call,
                          lambda fg, unit, j: _refuse_after_reduction(unit, j, call))
    if found is None:
        return
    fg, unit, j, local = found
    lo, hi, _span = fg.partition_span(unit, j)
    off = unit.offsets[j]
    # only this rank's elements are stored (_store's only_mine): the
    # others' are their ranks' to write
    whole = torch.zeros(unit.numels[j], dtype=torch.float32, device=local.device)
    if lo < hi:
        whole[lo - off:hi - off] = local
    _store(fg, unit, j, whole, only_mine=True)


def _engine_of(unit, j):
    return unit.params[j]._zero_place.engine()


def _sum_scale(engine) -> float:
    """What the step divides the held sums by ([Note: safe gradients])."""
    return engine.loss_scale * engine._comm.dp_world * engine.config.gradient_accumulation_steps


def _reduced(engine) -> bool:
    """The boundary's reduction ran already (clip_grad_norm_ before step)."""
    return engine._prepared is not None


def _averaged_whole(fg, unit, j) -> torch.Tensor:
    """safe_get_full_grad's value, flat, fp32, on the model's device (the
    collectives' too: NCCL takes no host tensor)."""
    engine = _engine_of(unit, j)
    if fg.grad_flat is not None and not _reduced(engine):
        # stages 0-1: this rank's own sum; the others' added into a copy
        fg.gather_stray_grads()
        whole = fg.view(fg.grad_flat, unit.members.start + j).detach().reshape(-1)
        whole = whole.to(torch.float32, copy=True)
        fg.comm.everyone.all_reduce_sum(whole)
    else:
        whole = param_whole(fg, unit, j, fg.grad_part)
        replicate = fg.comm.replicate
        if not _reduced(engine) and replicate is not None and replicate.world > 1:
            replicate.all_reduce_sum(whole)  # [Note: hybrid sharding]: done at the boundary
    return whole.div_(_sum_scale(engine))


def _refuse_after_reduction(unit, j, call):
    """The step clips by the norm clip_grad_norm_ took: a gradient written
    after it would be stepped on with another gradient's norm. Every rank
    is in the same state, so every rank refuses alike, before any change."""
    if _reduced(_engine_of(unit, j)):
        raise RuntimeError(f"{call}: the gradients were reduced and their norm taken "
                           "(engine.clip_grad_norm_) for the coming step; write gradients "
                           "before clip_grad_norm_")


def _store(fg, unit, j, whole, only_mine=False):
    """The held sums that the step turns into `whole` (averaged,
    unscaled): this rank's share of the sum the reduction will make.
    only_mine: the elements of this rank's partition are this rank's to
    set (the other ranks set theirs)."""
    engine = _engine_of(unit, j)
    held = whole * _sum_scale(engine)
    if fg.grad_flat is not None:
        # stages 0-1: the boundary sums every data-parallel rank's copy
        fg.gather_stray_grads()
        slot = fg.view(fg.grad_flat, unit.members.start + j).view(-1)
        with torch.no_grad():
            if not only_mine:
                slot.copy_(held / fg.comm.everyone.world)
                return
            # the ranks that hold this partition (its replicas; stage 0:
            # every rank) share its elements; the rest add nothing
            holders = fg.comm.everyone.world // fg.num_partitions
            lo, hi, _span = fg.partition_span(unit, j)
            off = unit.offsets[j]
            slot.zero_()
            if lo < hi:
                slot[lo - off:hi - off].copy_(held[lo - off:hi - off] / holders)
        return
    replicate = fg.comm.replicate
    if replicate is not None and replicate.world > 1:
        held /= replicate.world  # the boundary sums the replicas' partitions
    lo, hi, span = fg.partition_span(unit, j)
    if lo < hi:
        off = unit.offsets[j]
        fg.grad_part[span].copy_(held[lo - off:hi - off])

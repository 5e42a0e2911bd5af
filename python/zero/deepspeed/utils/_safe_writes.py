"""deepspeed.utils' writers of one parameter's fp32 values and optimizer
states: safe_set_full_fp32_param, safe_set_full_optimizer_state (the
whole value, given on every rank: each rank keeps its own elements) and
safe_set_local_fp32_param, safe_set_local_optimizer_state (this rank's
elements, flat, as safe_get_local_* gives them).

[Note: safe writes] DeepSpeed writes the fp32 partition only: the model's
16-bit copy keeps its old values until the next step copies the master
out, so a forward in between still sees them. Here the model's copy
follows at once, on every rank alike: a whole value (given on every rank)
goes into the gathered copy this rank holds, if any (stages 0-2, a
persistent stage-3 unit), rounded as a step rounds, and into the
compute-dtype shard a released stage-3 unit is gathered from; a local
value reaches only this rank's elements, so the parameter's place in a
gathered copy is summed again from every rank's shard. So a backward
through a graph built before the write is refused, as after a step (the
parameters' version counters moved; under DeepSpeed it runs, on the old
16-bit values). Every writer is a collective where the engine spans
ranks, and a value refused on one rank is refused on every rank before
anything changes (safe_access.located). The written master and states
are what the next step updates, and what checkpoints and safe_get_* read.
Like the readers, a parameter no engine trains is left alone (DeepSpeed's
setters do nothing for a frozen one)."""
from __future__ import annotations

import contextlib

import torch

from zero.deepspeed.utils._safe_access import located, param_whole


def safe_set_full_fp32_param(param, value):
    """Set the parameter's fp32 master to `value` (its whole shape, the
    same on every rank); the model's copy follows ([Note: safe writes])."""
    found = located_whole(param, value, "safe_set_full_fp32_param")
    if found is None:
        return
    fg, unit, j, whole = found
    with _not_a_users_write(fg):
        _write_master(fg, unit, j, whole)
        _write_model_copy(fg, unit, j, whole)


def safe_set_full_optimizer_state(param, value, optim_state_key):
    """Set one optimizer state of the parameter to `value` (its whole
    shape, the same on every rank)."""
    call = "safe_set_full_optimizer_state"
    found = located_whole(param, value, call,
                          lambda fg, unit, j: _state_to_write(fg, optim_state_key, call))
    if found is None:
        return
    fg, unit, j, whole = found
    target = _state_to_write(fg, optim_state_key, call)
    lo, hi, span = fg.partition_span(unit, j)
    if lo < hi:
        off = unit.offsets[j]
        target[span].copy_(whole[lo - off:hi - off])
    fg.release_offloaded()


def safe_set_local_fp32_param(param, value):
    """Set this rank's elements of the parameter's fp32 master (flat, as
    safe_get_local_fp32_param gives them)."""
    found = located_local(param, value, "safe_set_local_fp32_param")
    if found is None:
        return
    fg, unit, j, local = found
    lo, hi, span = fg.partition_span(unit, j)
    fg.check_shard_writable()
    fg.settle_copies()
    with _not_a_users_write(fg):
        if lo < hi:
            if fg.master is not fg.shard:
                fg.master[span].copy_(local)
            fg.shard[span].copy_(local)
        fg.release_offloaded()
        # every rank wrote its own elements: the parameter's place in a
        # gathered copy takes them all (the shard holds them rounded)
        _land_gather(fg, unit)
        if unit.gathered and unit.full is not None:
            _write_model_copy(fg, unit, j, param_whole(fg, unit, j, fg.shard))


def safe_set_local_optimizer_state(param, value, optim_state_key):
    """Set this rank's elements of one optimizer state of the parameter."""
    call = "safe_set_local_optimizer_state"
    found = located_local(param, value, call,
                          lambda fg, unit, j: _state_to_write(fg, optim_state_key, call))
    if found is None:
        return
    fg, unit, j, local = found
    target = _state_to_write(fg, optim_state_key, call)
    lo, hi, span = fg.partition_span(unit, j)
    if lo < hi:
        target[span].copy_(local)
    fg.release_offloaded()


def located_whole(param, value, call, more_checks=None):
    """(group, unit, index, value as fp32 on the model's device) for a
    writer of a whole value, its size checked on every rank alike
    (located); None for a parameter no engine trains."""
    def refusal_of(fg, unit, j):
        if more_checks is not None:
            more_checks(fg, unit, j)
        check_whole(value, unit, j, call)
    found = located(param, call, refusal_of)
    if found is None:
        return None
    fg, unit, j = found
    return fg, unit, j, as_flat(value, fg)


def located_local(param, value, call, more_checks=None):
    """(group, unit, index, value as fp32 on the model's device) for a
    local writer, its value's size checked on every rank alike
    (located); None for a parameter no engine trains."""
    def refusal_of(fg, unit, j):
        if more_checks is not None:
            more_checks(fg, unit, j)
        lo, hi, _span = fg.partition_span(unit, j)
        check_local(value, max(0, hi - lo), call)
    found = located(param, call, refusal_of)
    if found is None:
        return None
    fg, unit, j = found
    return fg, unit, j, as_flat(value, fg)


def check_whole(value, unit, j, call):
    _check_tensor(value, call)
    if value.numel() != unit.numels[j]:
        raise ValueError(f"{call}: value has {value.numel()} elements "
                         f"({tuple(value.shape)}) but the parameter has {unit.numels[j]} "
                         f"({tuple(unit.shapes[j])})")


def check_local(value, count, call):
    _check_tensor(value, call)
    if value.numel() != count:
        raise ValueError(f"{call}: value has {value.numel()} elements but this rank holds "
                         f"{count} of the parameter (safe_get_local_* gives them)")


def as_flat(value, fg):
    """A checked value, flat, fp32, on the model's device."""
    return value.detach().reshape(-1).to(fg.device, torch.float32)


def _check_tensor(value, call):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{call}: value must be a torch.Tensor, got {type(value).__name__}")
    if value.is_complex():
        raise TypeError(f"{call}: value must hold real numbers, got {value.dtype}")


def _state_to_write(fg, key, call):
    if not fg.states:
        raise KeyError(f"optim_state_key {key!r}: the optimizer keeps no states (SGD "
                       "without momentum)")
    if key not in fg.states:
        raise KeyError(f"optim_state_key {key!r}: the optimizer keeps {sorted(fg.states)}")
    if fg.step_count == 0:
        raise RuntimeError(f"{call}: the optimizer has no state {key!r} before its first "
                           "update (safe_get_full_optimizer_state gives None then); step once "
                           "first")
    return fg.states[key]


def _write_master(fg, unit, j, whole):
    """This rank's elements of `whole` into the master and the shard."""
    lo, hi, span = fg.partition_span(unit, j)
    if lo >= hi:
        return
    fg.check_shard_writable()
    fg.settle_copies()
    off = unit.offsets[j]
    mine = whole[lo - off:hi - off]
    if fg.master is not fg.shard:
        fg.master[span].copy_(mine)
    fg.shard[span].copy_(mine)  # rounded to the compute dtype, as a step rounds
    fg.release_offloaded()


def _land_gather(fg, unit):
    if unit.work is not None:  # a gather in flight: let it land first
        unit.params[0]._zero_place.schedule.ensure(fg, unit)


def _write_model_copy(fg, unit, j, whole):
    """The whole value into the gathered unit this rank holds, if any
    (rounded to the compute dtype by the copy, as a step rounds)."""
    _land_gather(fg, unit)
    if not unit.gathered or unit.full is None:
        return  # released: the next gather reads the shard written above
    off, n = unit.offsets[j], unit.numels[j]
    with torch.no_grad():
        unit.full[off:off + n].copy_(whole)


@contextlib.contextmanager
def _not_a_users_write(fg):
    """The parameters' version counters move when the buffers they view
    are written (views share their base's counter), which the next step
    would take for a user's write to take in ([Note: parameter writes] in
    sharding/_param_writes.py): the counters of parameters not written
    before are recorded again after."""
    seen = getattr(fg, "seen_versions", None)
    clean = [] if seen is None else \
        [i for i, p in enumerate(fg.params) if p._version == seen[i]]
    try:
        yield
    finally:
        for i in clean:
            seen[i] = fg.params[i]._version

"""deepspeed.utils' readers of one parameter's fp32 values and optimizer
states: safe_get_full_fp32_param, safe_get_full_optimizer_state (the
whole tensor on every rank: a collective where the engine partitions)
and safe_get_local_fp32_param, safe_get_local_optimizer_state (this
rank's elements of it, flat, as DeepSpeed gives them at stage 3). They
read the engine's fp32 master and states through the parameter's place
(`_zero_place`), after any pending write or delayed update is taken in
(take_in_parameter_writes, as full_state_dict does). A parameter no
engine trains gives None, and so does a state before the first update,
as DeepSpeed's. The values are on the model's device, as DeepSpeed's are
on the accelerator. The writers: _safe_writes.py; gradients: _safe_grads.py."""
from __future__ import annotations

import torch

from zero.sharding._param_writes import take_in_parameter_writes


def located(param, call, refusal_of=None):
    """(group, unit, index in unit) of a trained parameter, its engine's
    pending writes taken in; None for a parameter no engine trains.
    refusal_of(group, unit, index): a writer's checks of its arguments,
    raising; what it raises on any rank is raised on every rank, before
    anything changes ([Note: writes agreed] in sharding/_step_agreement.py:
    a value refused on one rank left the others waiting in a collective,
    or writing while it did not)."""
    if not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"param must be a torch.nn.Parameter, got {type(param).__name__}")
    place = getattr(param, "_zero_place", None)
    engine = place.engine() if place is not None else None
    if engine is None or engine._closed or not place.fg.trainable:
        return None
    j = next(j for j, p in enumerate(place.unit.params) if p is param)
    refusal = None
    if refusal_of is not None:
        try:
            refusal_of(place.fg, place.unit, j)
        except (TypeError, ValueError, KeyError, RuntimeError) as error:
            refusal = error
    take_in_parameter_writes(engine.all_groups, engine.call_text(f"{call}()"), refusal)
    return place.fg, place.unit, j


def param_whole(fg, unit, j, source):
    """Parameter j's elements of `source` (a tensor laid out as the
    partition: master, shard, a state, the gradient partition), fp32, flat,
    whole on every rank, on the model's device: each rank puts the elements
    its partition holds into zeros and the partitions' group sums them. A
    collective of the parameter's size, on the device the group's backend
    takes (NCCL takes no host tensor); gathering the unit instead cost a
    whole param group's fp32 bytes at stages 0-2 for one parameter."""
    lo, hi, span = fg.partition_span(unit, j)
    off, n = unit.offsets[j], unit.numels[j]
    whole = torch.zeros(n, dtype=torch.float32, device=fg.device)
    if lo < hi:
        whole[lo - off:hi - off] = source[span].detach().to(fg.device, torch.float32)
    if fg.num_partitions > 1:
        fg.comm.all_reduce_sum(whole)
    return whole


def _whole(fg, unit, j, source):
    """Parameter j, fp32, whole, in its shape (DeepSpeed's are on the
    accelerator: p * safe_get_full_grad(p) works)."""
    return param_whole(fg, unit, j, source).view(unit.shapes[j])


def _local(fg, unit, j, source):
    lo, hi, span = fg.partition_span(unit, j)
    if lo >= hi:
        return torch.empty(0, dtype=torch.float32, device=fg.device)
    return source[span].detach().to(fg.device, torch.float32, copy=True)


def safe_get_full_fp32_param(param):
    """The parameter's fp32 master values, whole (a collective where the
    engine partitions)."""
    found = located(param, "safe_get_full_fp32_param")
    return None if found is None else _whole(*found, found[0].master)


def safe_get_full_optimizer_state(param, optim_state_key):
    """One optimizer state of the parameter ("exp_avg", "exp_avg_sq",
    "momentum_buffer", ...), whole; None before the first update."""
    found = located(param, "safe_get_full_optimizer_state")
    state = _state(found, optim_state_key)
    return None if state is None else _whole(*found, state)


def safe_get_local_fp32_param(param):
    """This rank's elements of the parameter's fp32 master, flat."""
    found = located(param, "safe_get_local_fp32_param")
    return None if found is None else _local(*found, found[0].master)


def safe_get_local_optimizer_state(param, optim_state_key):
    """This rank's elements of one optimizer state of the parameter, flat."""
    found = located(param, "safe_get_local_optimizer_state")
    state = _state(found, optim_state_key)
    return None if state is None else _local(*found, state)


def _state(found, key):
    if found is None:
        return None
    fg = found[0]
    if fg.step_count == 0 or key not in fg.states:
        if fg.states and key not in fg.states:
            raise KeyError(f"optim_state_key {key!r}: the optimizer keeps "
                           f"{sorted(fg.states)}")
        return None
    return fg.states[key]

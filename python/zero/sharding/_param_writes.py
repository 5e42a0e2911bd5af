"""Values written straight into the parameters, outside the engine: kept.

[Note: parameter writes] The engine owns each parameter's value in its
partition (the fp32 master, stage 3's shard) and copies the update out into
the parameters, so a value written into a parameter after initialize
(model.load_state_dict, nn.init under no_grad, p.data = ..., a
model.float() and back) would be overwritten by the next step.
- Each parameter's version counter (torch bumps it on every in-place op
  through the parameter) is recorded after every step; where its unit is
  gathered, the parameter must still be a view of the unit's buffer.
- Before a step, a checkpoint or full_state_dict, a parameter whose
  counter moved, or whose .data was replaced by a tensor of the same
  dtype, shape and device, is taken in: its values go into the unit's
  buffer, and the elements that differ from the rounded master go into
  this rank's partition (so untouched elements keep their fp32 bits, as
  with GatheredParameters(modifier_rank=...)). Every rank takes in its
  own values, so write the same values on every rank (as DDP expects):
  the ranks check that they did ([Note: writes agreed] in _step_agreement.py).
- A parameter cast or moved (another dtype or device) is refused by
  name, and so is a change to a released stage-3 parameter (an empty
  placeholder: the values were never there), in place or by p.data = ....
- Inside zero.GatheredParameters the listed parameters are gathered, so
  p.data = ... there is taken back into the unit's buffer on exit, before
  the write-back of modifier_rank.
- After a step the counters are bumped, so autograd refuses a backward
  through a graph built before the step, as it does after torch.optim's.
"""
from __future__ import annotations

from operator import attrgetter
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from zero.sharding._copying import none
from zero.sharding._step_agreement import (agree, different_calls, hash_settings, hash_writes,
                                  other_rank_refused)


class Place(NamedTuple):
    """Where a managed parameter lives (the `_zero_place` attribute). A
    pickled parameter (torch.save(model)) gets None: see _copying.py."""
    fg: object          # its FlatGroup
    unit: object        # its Unit
    schedule: object    # stage 3's schedule, or None
    engine: object      # weakref to the Engine

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (none, ())


def record_parameters(groups):
    for fg in groups:
        fg.seen_versions = [p._version for p in fg.params]


def bump_versions(fg):
    increment_version(fg.params)
    fg.seen_versions = [p._version for p in fg.params]


def _slot(unit, j):
    off, n = unit.offsets[j], unit.numels[j]
    return unit.full[off:off + n].view(unit.shapes[j])


def check_parameters_in_place(groups):
    """Re-point a parameter of a gathered unit whose .data was replaced by
    an equal kind of tensor (its values are copied in and taken in at the
    next step); refuse one cast or moved. Returns nothing; marks."""
    for fg in groups:
        for unit in fg.units:
            if not unit.gathered or unit.work is not None or unit.full is None:
                continue
            item = unit.full.element_size()
            base = unit.full.data_ptr()
            for j, p in enumerate(unit.params):
                if p.data_ptr() == base + unit.offsets[j] * item and \
                        p.dtype == unit.full.dtype:
                    continue
                name = fg.names[unit.members.start + j]
                if p.dtype != unit.full.dtype or p.device != unit.full.device or \
                        p.shape != unit.shapes[j]:
                    raise _cast_error(name, p, unit, j)
                slot = _slot(unit, j)
                with torch.no_grad():
                    slot.copy_(p.detach())
                p.data = slot
                fg.seen_versions[unit.members.start + j] = -1  # taken in at the next step


def take_in_parameter_writes(groups, call: str, refusal: Exception | None = None,
                             settings: str = "", left_out=frozenset()) -> list:
    """Before a step or a read of the partitions: see [Note: parameter
    writes]. A collective where the groups span several ranks: the ranks
    agree that they are in the same `call` (its name and the engine's
    counts), on what was written, on `settings` (describe_settings of the
    step's param groups) and on whether any refuses ([Note: writes agreed]
    in _step_agreement.py). `refusal` is the caller's own check's error on
    this rank, raised once the ranks have compared notes. left_out: keys
    (group index, parameter index in the group) whose writes are neither
    compared nor taken in, returned instead as (group, unit, index in unit):
    zero.GatheredParameters' modifier rank's values replace them on every
    rank."""
    problem, written, passed_over = refusal, [], []
    # an update computed on another thread ([Note: delayed update] in
    # step/_delayed.py) lands here, once every rank is here
    delayed = [d for d in {id(fg.delayed): fg.delayed for fg in groups
                           if fg.delayed is not None}.values() if d.pending]
    failed = False  # an update thread's failure here: nothing consistent to land
    for d in delayed:
        failure = d.wait()
        failed = failed or failure is not None
        problem = problem or failure
    if problem is None:
        try:
            check_parameters_in_place(groups)
            written = _writes(groups)
            if left_out:
                passed_over = [w for w in written
                               if (w[0].index, w[1].members.start + w[2]) in left_out]
                written = [w for w in written if w not in passed_over]
        except RuntimeError as error:  # raised once the ranks have compared notes
            problem = error
    # (the writes left out too: the pending update would land over them)
    if problem is None and (written or passed_over) and any(d.pending for d in delayed):
        problem = delayed[0].refuse_writes(written + passed_over)
    if groups and groups[0].comm.dp_world > 1:
        verdict = agree(groups[0].comm, call, hash_writes(written), hash_settings(settings),
                        refused=problem is not None)
        if not verdict.same_call:
            raise different_calls(call)  # the ranks are elsewhere: nothing collective
        if problem is None and verdict.other_refused:
            problem = other_rank_refused()
        elif problem is None and not verdict.writes_alike:
            problem = _writes_differ(groups, written)
        elif problem is None and not verdict.settings_alike:
            problem = _settings_differ(settings)
    # landed on every rank (they are all in this call), refused or not: a
    # refusal leaves the model at the engine's values, the last update in
    # (a write refused while it was computed stayed in the parameters the
    # next forward used, though the refusal said it was dropped). Not when
    # a rank's update failed: it lands nothing (partly applied), and the
    # others' gathers would meet no peer; the ranks learn that in one more
    # sum, taken only on a refusal with updates pending, which every rank
    # sees alike (docs/offload.md: load a checkpoint after such a failure)
    if delayed and problem is not None and groups[0].comm.dp_world > 1:
        failed = groups[0].comm.everyone.sum_scalar(float(failed)) > 0
    if not failed:
        for d in delayed:
            d.land()
    if problem is not None:
        raise problem
    for fg, unit, j in written:
        write_into_partition(fg, unit, j, None)
        fg.seen_versions[unit.members.start + j] = unit.params[j]._version
    return passed_over


def _writes(groups) -> list:
    """(group, unit, index in unit) of each parameter written since its
    version was recorded; raises for a write a released unit cannot keep."""
    written = []
    for fg in groups:
        for unit in fg.units:
            for j, p in enumerate(unit.params):
                i = unit.members.start + j
                released = not unit.gathered or unit.work is not None
                if not (_released_changed(p, fg.seen_versions[i]) if released
                        else p._version != fg.seen_versions[i]):
                    continue
                if released:
                    raise _lost_change(fg, unit, j)
                written.append((fg, unit, j))
    return written


def _writes_differ(groups, written) -> RuntimeError:
    names = [fg.names[unit.members.start + j] for fg, unit, j in written]
    renormed = [name for (fg, unit, j), name in zip(written, names)
                if id(unit.params[j]) in fg.renormed_in_forward]
    if renormed:
        return RuntimeError(
            f"parameter '{renormed[0]}' was written in the forward and not alike on every "
            "rank: it is the weight of an nn.Embedding (or EmbeddingBag) with max_norm, whose "
            "rows torch renormalizes in place as each rank looks them up, so the ranks' "
            "copies come apart with their data (DDP lets them drift apart silently). Each rank "
            "keeps its own slice of one model here: set max_norm=None (a penalty on the rows' "
            "norms in the loss does the same alike on every rank), or train on one rank. "
            "Nothing was taken in")
    listed = ", ".join(f"'{n}'" for n in names[:4]) + (" ..." if len(names) > 4 else "")
    return RuntimeError(
        "parameters were written since the last step, and not alike on every rank (this "
        f"rank wrote {listed or 'none'}; another rank wrote other parameters or other "
        "values). Each rank keeps its own slice of the model, so the ranks' slices would "
        "come from different models: make the same write on every rank (load the state dict "
        "on every rank, seed nn.init alike), or write on one rank inside "
        "zero.GatheredParameters(params, modifier_rank=that rank). Nothing was taken in")


def _settings_differ(settings) -> RuntimeError:
    return RuntimeError(
        "the optimizer's param group settings are not alike on every rank (this rank has "
        f"{settings}). Each rank updates its own slice of the model with its own settings, "
        "so the slices would train differently: change a setting (group['lr'] = ...) on "
        "every rank alike. Nothing was updated on any rank")


def _cast_error(name, p, unit, j) -> RuntimeError:
    if p.dtype == unit.full.dtype and p.device == unit.full.device:
        return RuntimeError(
            f"parameter '{name}' now has shape {tuple(p.shape)}, but the engine trains it as "
            f"{tuple(unit.shapes[j])}: it was resized after zero.initialize (p.data = a tensor "
            "of another shape; HF's resize_token_embeddings does this). The engine laid out "
            "its partitions and optimizer states for the shapes at initialize: resize before "
            "zero.initialize, or call it again after with a new optimizer (the states of this "
            "one keep the old shape; the old engine's close() leaves the resized parameter "
            "as it is)")
    return RuntimeError(
        f"parameter '{name}' is now {p.dtype} {tuple(p.shape)} on {p.device}, but the engine "
        f"trains it as {unit.full.dtype} {tuple(unit.shapes[j])} on {unit.full.device}: the "
        "model was cast or moved after zero.initialize (model.float(), .half(), .to(...)). "
        f"Cast it back (model.to({unit.full.dtype})), or call zero.initialize again")


_VERSION, _DTYPE, _DEVICE = attrgetter("_version"), attrgetter("dtype"), attrgetter("device")
# a released parameter's placeholder holds no bytes ([Note: released parameters])
_STORAGE, _STORAGE_BYTES = torch.Tensor.untyped_storage, torch.UntypedStorage.nbytes


def check_released_untouched(fg, unit):
    """Before a released unit is gathered (which re-points its parameters):
    refuse a change made to one of them, which the gather would drop, and a
    cast of its placeholder (model.half()), which the gather would undo."""
    seen = getattr(fg, "seen_versions", None)
    if seen is None:  # the engine is still being built
        return
    full = unit.full
    dtype, device, first = full.dtype, full.device, unit.members.start
    params = unit.params
    n = len(params)
    # twice a step per unit: the whole unit read by map (loops in C, half
    # the time of the loop below), the loop only to name what changed
    if list(map(_VERSION, params)) == seen[first:first + n] and \
            not any(map(_STORAGE_BYTES, map(_STORAGE, params))) and \
            list(map(_DTYPE, params)).count(dtype) == n and \
            list(map(_DEVICE, params)).count(device) == n:
        return
    for j, p in enumerate(params):
        if p.dtype != dtype or p.device != device:
            raise _cast_error(fg.names[first + j], p, unit, j)
        if _released_changed(p, seen[first + j]):
            raise _lost_change(fg, unit, j)


def write_in_forward_refusal(fg, unit):
    """The error for a released unit's parameter written in place while
    its module's forward had it gathered (w.clamp_() under no_grad), or
    None. The release drops the gathered values, so the write would be
    lost, and the backward would compute with the values from before it:
    refused as the forward ends, before anything trains on it (it used to
    surface at the next gather, blamed on a write outside the forward,
    after a step of gradients taken at other weights). The engine goes on
    from the values it kept."""
    seen = getattr(fg, "seen_versions", None)
    first, params = unit.members.start, unit.params
    if seen is None or list(map(_VERSION, params)) == seen[first:first + len(params)]:
        return None
    j = next(j for j, p in enumerate(params) if p._version != seen[first + j])
    fg.seen_versions[first:first + len(params)] = [p._version for p in params]
    return RuntimeError(
        f"parameter '{fg.names[first + j]}' was written in place during a forward at stage 3 "
        "(an in-place op on the parameter, e.g. w.clamp_() under torch.no_grad()). Its unit is "
        "released when the forward ends, which would drop the write, and its backward would "
        "use the values from before it, so the forward is refused; the engine goes on from "
        "the values it had. Make the write between steps inside "
        "zero.GatheredParameters([w], modifier_rank=0), keep the unit gathered "
        "(stage3_param_persistence_threshold above its size), or use stage 2")


def released_writes_refusal(groups, by: str):
    """The refusal of a change `by` something (the optimizer's step
    post-hooks) made to a released stage-3 parameter, the change dropped as
    it is named (_lost_change); None when there is none. Found at once,
    rather than at the next step, whose refusal named no cause. Writes to
    gathered units are left for the next step to take in, as any others."""
    try:
        _writes([fg for fg in groups if getattr(fg, "seen_versions", None) is not None])
    except RuntimeError as error:
        return RuntimeError(f"{by} wrote a parameter: {error}")
    return None


def _lost_change(fg, unit, j) -> RuntimeError:
    """The error for a change the released unit cannot keep. The change is
    dropped as it is reported (the placeholder back, the version seen), so
    training can go on from the values the engine kept, and the write can
    be made again where it is kept."""
    i = unit.members.start + j
    p = unit.params[j]
    if unit._placeholder is not None:
        p.data = unit._placeholder
    fg.seen_versions[i] = p._version
    place = getattr(p, "_zero_place", None)
    engine = place.engine() if place is not None else None
    # every such change of the engine at once: a write over the whole model
    # (vector_to_parameters, an EMA swap) was refused once per parameter
    others = _drop_lost_changes(engine.all_groups if engine is not None else [fg])
    more = f" (and {others} more parameters)" if others > 0 else ""
    return RuntimeError(
        f"parameter '{fg.names[i]}'{more} was changed (in place, or by p.data = ...) where "
        "stage 3 cannot keep the change (released: an empty placeholder outside its "
        "module's forward; or inside zero.GatheredParameters without modifier_rank), so it "
        "was dropped: the engine goes on from the values it had. Change parameters inside "
        "zero.GatheredParameters(params, modifier_rank=0), or load weights with "
        "engine.load_checkpoint")


def _released_changed(p, seen_version) -> bool:
    """Whether released parameter p changed since its version was seen:
    written in place (its version moved), or given a tensor of its own by
    p.data = ... (the version stays; the placeholder holds no bytes, any
    other tensor does, even an empty one: vector_to_parameters gives each
    released parameter a 0-element slice of its vector)."""
    return p._version != seen_version or _STORAGE_BYTES(_STORAGE(p)) != 0


def _drop_lost_changes(groups) -> int:
    """Put every released parameter changed since it was seen back on its
    placeholder, its version seen; returns how many there were."""
    count = 0
    for fg in groups:
        seen = getattr(fg, "seen_versions", None)
        for unit in fg.units:
            if (unit.gathered and unit.work is None) or seen is None:
                continue
            for j, p in enumerate(unit.params):
                i = unit.members.start + j
                if not _released_changed(p, seen[i]):
                    continue
                if unit._placeholder is not None:
                    p.data = unit._placeholder
                seen[i] = p._version
                count += 1
    return count


def take_changed_elements(master, new, old=None):
    """master (fp32) = new where new differs from `old` (its values before
    the write), or, with old=None, from the master rounded to new's dtype;
    elsewhere the master keeps its fp32 bits."""
    new = new.to(master.device)  # the master may be on the host
    old = master.to(new.dtype) if old is None else old.to(master.device)
    master.copy_(torch.where(new != old, new.float(), master))


def write_into_partition(fg, unit, j, before):
    """This rank's chunk of unit parameter j, from the unit's buffer, into
    the shard and the master: the elements that differ from `before` (the
    values on entry to GatheredParameters), or, with before=None, from the
    master rounded to the compute dtype."""
    lo, hi, span = fg.partition_span(unit, j)
    if lo >= hi:
        return
    fg.check_shard_writable()
    fg.settle_copies()
    new = unit.full[lo:hi]
    shard = fg.shard[span]
    if shard.data_ptr() != new.data_ptr():
        shard.copy_(new)
    fg.drop_param_pages(span)  # [Note: shard on a disk]
    if not fg.trainable or fg.master is fg.shard:
        return
    master = fg.master[span]
    old = None if before is None else before[lo - unit.offsets[j]:hi - unit.offsets[j]]
    take_changed_elements(master, new, old)
    if fg.offload is not None:
        # the master's file: unmap it all, as reading it mapped
        # neighbouring pages too (the kernel's fault-around)
        fg.offload.drop("master")

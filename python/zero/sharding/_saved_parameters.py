"""Stage 3's saved-tensor hooks ([Note: saved parameters] in _stage3.py):
a tensor autograd saves that lies in a unit's storage is kept as where it
lies, and gathered again when backward unpacks it, whether or not its
unit is still gathered then. A persistent unit's (gathered for good) is
kept as it is, with its version: nothing to gather, and the bookkeeping of
where it lies cost a third of stage 3's overhead in
bench/stage3_overhead.py (2.0 against 1.35 ms a step)."""
from __future__ import annotations

import bisect

import torch
from torch.autograd.graph import saved_tensors_hooks

from zero.sharding._units import storage_key


class SavedParameters:
    """Mixed into Stage3Schedule: its pack and unpack hooks, and the
    storage keys (unit_by_storage) they look units up by."""

    def _pack(self, tensor):
        # called for every tensor the forward saves (237 a step in
        # stage3_overhead.py): the common case, an activation under no
        # outer hooks, returns at once. storage_key's body inline: its
        # call measured 0.1 ms a step (3.11-3.18 against 3.20-3.35 ms of
        # overhead in three alternating pairs of --released runs)
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            key = None
        entry = self.unit_by_storage.get(key)
        if entry is None and key in self.placeholder_units:
            raise self._released_read(tensor, self.placeholder_units[key])
        if entry is None and self._outer is None:
            # [Note: saved without their node] an activation, kept without
            # its autograd node (torch rebuilds that at unpack). An op that
            # saves its own output (tanh, softmax, attention) gets it with
            # its grad_fn, the op's own node: kept as it is, the node held
            # itself, a cycle through C++ that Python's collector never
            # frees, so a forward without a backward (a validation loss
            # outside no_grad) kept its graph and activations for good
            return tensor.detach() if tensor.requires_grad else tensor
        return self._pack_entry(tensor, entry, self._outer)

    def _released_read(self, tensor, entry) -> RuntimeError:
        """A released parameter's placeholder saved for backward: a
        forward computed with it, so with no values (a sum over
        `self.parameters()` got 0.0, and the backward failed on a shape of
        [0]). Named while the forward runs."""
        fg, unit = entry
        name = next((fg.names[unit.members.start + j] for j, p in enumerate(unit.params)
                     if p is tensor), fg.names[unit.members.start])
        return RuntimeError(
            f"zero stage 3: parameter '{name}' was used in this forward while released (it "
            "holds no values here: an empty placeholder). A read by attribute inside a "
            "forward (module.weight) is gathered, but not one through parameters() or "
            "named_parameters(), nor one outside a forward. Read it by attribute, or "
            "register it on the module whose forward reads it: "
            "engine.register_external_parameter(module, param); outside a forward, use "
            "zero.GatheredParameters([param])")

    def _keyed_anew(self, unit, old_key):
        """unit_by_storage after `unit.full` changed storage (old_key: the
        one it had; None: it did not change). Not found: an interrupt came
        between a storage change and its re-keying, which left a stale key
        (its address may be another storage's next): swept, and keyed anew."""
        if old_key is None:
            return
        entry = self.unit_by_storage.pop(old_key, None)
        if entry is None:
            entry = self.place[id(unit.params[0])]
            for key in [k for k, (_fg, u) in self.unit_by_storage.items() if u is unit]:
                del self.unit_by_storage[key]
        self.unit_by_storage[storage_key(unit.full)] = entry

    def saving_outside_forward(self):
        """The saved-tensor hooks for a block that computes with gathered
        parameters outside forward (zero.GatheredParameters): a loss term
        like w.pow(2) taken there saves w itself, released at the block's
        end, so its backward must gather it again ([Note: saved
        parameters]). The hooks in force at entry get every other tensor."""
        outer = outer_saved_tensors_hooks()
        return saved_tensors_hooks(lambda tensor: self._pack_with(tensor, outer), self._unpack)

    def _pack_with(self, tensor, outer):
        return self._pack_entry(tensor, self.unit_by_storage.get(storage_key(tensor)), outer)

    def _pack_entry(self, tensor, entry, outer):
        """[Note: saved parameters]: a saved tensor in a unit's storage
        (entry: its (group, unit), else None) is kept as where it lies in
        its unit, to be gathered again if released by then (not as a view:
        see [Note: released parameters])."""
        if entry is not None and self.removed:
            entry = None  # hooks left on under someone else's (see remove): as they are
        if entry is not None:
            fg, unit = entry
            if unit.persistent:
                return _SavedAsIs(tensor)
            if self.place.get(id(tensor), (None, None))[1] is unit:
                return _SavedParameter(fg, unit, tensor)  # the parameter itself (a weight)
            if tensor.dtype == unit.full.dtype:
                return _SavedInUnit(fg, unit, tensor)
            return _SavedView(fg, unit, tensor)  # reinterpreted bytes: kept as it is
        if outer is None:
            return tensor
        pack, unpack = outer
        return _SavedByOuter(unpack, pack(tensor))

    def _unpack(self, packed):
        kind = type(packed)
        if kind not in _PACKED_HERE:  # the common case first: a tensor saved as it is
            return packed
        if kind is _SavedByOuter:
            return packed.unpack(packed.packed)
        if self.removed:
            self._refuse_if_removed()
        if not self.backward.running:  # checked here: a call less for each of 80 a step
            self.begin_backward()
        if kind is _SavedAsIs:
            if packed.tensor._version != packed.version:
                _modified_in_place(packed.tensor, packed.version)
            return packed.tensor
        unit = packed.unit
        if not unit.gathered:
            self.ensure(packed.fg, unit)
        if kind is _SavedView:
            return packed.tensor
        param = packed.param
        if param is not None and param._version != packed.version:
            _modified_in_place(param, packed.version)
        if kind is _SavedParameter:
            return param  # its data is its view of the gathered unit
        return unit.full.as_strided(packed.size, packed.stride, packed.offset)


def _modified_in_place(tensor, expected):
    """torch's own error for a saved tensor changed before its backward
    (with saved-tensor hooks torch leaves the check to the hooks)."""
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: a parameter of shape {tuple(tensor.shape)} is at version "
        f"{tensor._version}; expected version {expected}")


class _SavedAsIs:
    """A saved tensor in a persistent unit's storage (gathered for good):
    the tensor itself, and its version then (a view of a parameter shares
    the parameter's counter, which the step and in-place changes bump)."""
    __slots__ = ("tensor", "version")

    def __init__(self, tensor):
        # without its node ([Note: saved without their node])
        self.tensor, self.version = tensor.detach(), tensor._version


class _SavedParameter:
    """A released unit's parameter saved itself (most saved tensors in a
    unit: a Linear's weight), with its version: at unpack the parameter
    once its unit is gathered again, which points it at its place there.
    Cheaper than _SavedInUnit's search and view: 83 of them a step in
    stage3_overhead.py --released."""
    __slots__ = ("fg", "unit", "param", "version")

    def __init__(self, fg, unit, param):
        self.fg, self.unit, self.param, self.version = fg, unit, param, param._version


class _SavedInUnit:
    """A saved tensor that lies in a stage-3 unit's storage: where (its
    size, strides and offset in the unit's buffer), and the parameter it
    lies in with that parameter's version (torch checks versions of what it
    saves itself; with a hook the hook must; the step bumps them)."""
    __slots__ = ("fg", "unit", "size", "stride", "offset", "param", "version")

    def __init__(self, fg, unit, tensor):
        self.fg, self.unit = fg, unit
        self.size, self.stride = tensor.shape, tensor.stride()
        self.offset = tensor.storage_offset()
        j = bisect.bisect_right(unit.offsets, self.offset) - 1
        self.param = unit.params[j] if j >= 0 else None
        self.version = self.param._version if self.param is not None else 0


class _SavedView:
    """A saved tensor of a unit's storage under another dtype, kept as it
    is (the unit is gathered again into its storage before it is read)."""
    __slots__ = ("fg", "unit", "tensor")

    def __init__(self, fg, unit, tensor):
        # without its node ([Note: saved without their node])
        self.fg, self.unit, self.tensor = fg, unit, tensor.detach()


class _SavedByOuter:
    """A saved tensor handed to the hooks that were in force when the
    root's forward began, with their unpack."""
    __slots__ = ("unpack", "packed")

    def __init__(self, unpack, packed):
        self.unpack, self.packed = unpack, packed


_PACKED_HERE = frozenset({_SavedAsIs, _SavedParameter, _SavedInUnit, _SavedView, _SavedByOuter})


def outer_saved_tensors_hooks():
    """The saved-tensor hooks in force (pack, unpack), or None. torch has
    no public call for this; without the private one, other tensors are
    saved as they are (as before any outer hooks)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None

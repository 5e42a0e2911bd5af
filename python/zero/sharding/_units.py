"""A unit: parameters laid out together and partitioned as one piece.

At stages 0-2 a whole param group is one unit that stays gathered. At
stage 3 each module's own parameters form a unit that is all-gathered just
before use and released after (_stage3.py). See [Note: flat group layout]
in _flat_group.py.

[Note: released parameters] A released unit's parameters point at an empty
placeholder (shape (0,)), as under DeepSpeed's stage 3, so code that reads
them by mistake fails on a shape mismatch instead of reading freed memory.
The `full` buffer's storage is resized to zero bytes, so the next gather
reuses the same storage object. But a tensor that still views it (a
forward hook that kept m.weight.detach() for logging, a view kept past a
GatheredParameters block) would then read freed memory: a segfault. So
when anything but `full` still holds the storage, the unit leaves it to
them, with the values it had, and takes a new storage for its next gather.
Stage 3's saved-tensor hook keeps no view of a unit (only where in it),
so autograd's saved tensors never hold the storage. On gloo a few releases
in a hundred find one more holder for a moment: the backend's worker thread
drops its reference to an all-gather's output just after wait() returns
(measured: every such storage was free 5 ms later), so the swap costs an
allocation, not memory.
"""
from __future__ import annotations

import torch

from zero.sharding._ds_attributes import AVAILABLE, NOT_AVAILABLE

ALIGN = 16  # chunk sizes are multiples of 16 elements (64-byte rows)
# Each parameter starts at a multiple of 64 elements: GEMM libraries run
# slower on operands that start mid-cache-line.
PARAM_ALIGN = 64


class Unit:
    def __init__(self, index, members, params, num_partitions, shard_offset, layout_offset):
        self.index = index
        self.members = members            # range of param indices in the group
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = []
        start = 0
        for n in self.numels:
            start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
            self.offsets.append(start)
            start += n
        self.span = start                 # laid-out elements, gaps included
        per = -(-self.span // num_partitions)
        self.part = -(-per // ALIGN) * ALIGN  # elements of one rank's chunk
        self.total = self.part * num_partitions
        self.numel = sum(self.numels)
        self._layout = (tuple(self.offsets), tuple(tuple(sh) for sh in self.shapes))
        self.shard_offset = shard_offset  # this unit's chunk in the rank's partition
        self.shard_slice = slice(shard_offset, shard_offset + self.part)
        self.layout_offset = layout_offset  # this unit in the unsharded layout
        self.full = None                  # [total] compute dtype (a property: see below)
        self.gathered = False
        self.persistent = False
        self.leaf = False                 # all the parameters of a stage3 leaf module
        self.work = None                  # an all-gather in flight
        self.active = 0                   # forwards running that need it
        self._placeholder = None
        self._spare = None                # see _take_spare
        self.says_status = False          # ds_status ([Note: DeepSpeed's parameter attributes])

    def chunk(self, t, r):
        return t[r * self.part:(r + 1) * self.part]

    # [Note: parameter views] Each parameter's view of `full` is made once
    # per storage and kept: slicing and viewing cost 2.6 us a parameter
    # against 0.2 us for setting .data, and stage 3 points a unit's
    # parameters at `full` after every gather (twice a step). A view stays
    # valid across the storage's resize to zero and back (it reads the
    # storage's pointer when used). The views belong to the storage, not
    # the unit: `attached` maps a layout (offsets and shapes) to its views,
    # and travels with the buffer into the gather pool and out to the next
    # unit of the same size (blocks of one model share a layout, so they
    # find their views made). They count as the storage's holders when a
    # release asks whether somebody else views it. A new `full` (the
    # setter) starts with none.
    @property
    def full(self):
        return self._full

    @full.setter
    def full(self, tensor):
        self._full = tensor
        self._attached = {}  # layout -> views of `tensor`'s storage
        self._views = None   # this unit's layout's, once made

    def point_params(self):
        views = self._views
        if views is None:
            full = self._full
            views = self._views = self._attached.setdefault(self._layout, [
                full[off:off + n].view(shape) for off, n, shape in
                zip(self.offsets, self.numels, self.shapes)])
        for p, view in zip(self.params, views):
            p.data = view
        if self.says_status:
            self._say_status(AVAILABLE)

    def _say_status(self, status):
        for p in self.params:
            p.ds_status = status

    def release(self, pool=None):
        """Free the gathered values (see [Note: released parameters]), or
        hand them to `pool` ([Note: gather pool]). Returns the storage key
        `full` had when it got a new storage (another holder kept the old,
        or the pool took it), else None. Tensors made here must be
        ordinary ones even when the release comes at the end of an eval
        under torch.inference_mode(): an inference tensor could not be
        gathered into by a training step."""
        if torch.is_inference_mode_enabled():  # entering the mode costs 10 us a unit
            with torch.inference_mode(False):
                return self.release(pool)
        old_key = storage_key(self.full)
        return old_key if self._release(pool) else None

    def placeholder(self):
        """The empty tensor a released parameter points at, one a unit
        (its storage tells stage 3's saved-tensor hook that a released
        parameter was read: [Note: parameters read by attribute])."""
        if self._placeholder is None:
            self._placeholder = torch.empty(0, dtype=self.full.dtype,
                                            device=self.full.device)
        return self._placeholder

    def _release(self, pool) -> bool:
        placeholder = self.placeholder()
        for p in self.params:
            p.data = placeholder
        if self.says_status:
            self._say_status(NOT_AVAILABLE)
        self.gathered = False
        storage = self.full.untyped_storage()
        # holders: `full`, `storage` here and the parameter views ([Note:
        # parameter views]); any more is somebody's view
        ours = 2 + sum(len(views) for views in self._attached.values())
        viewed = torch._C._storage_Use_Count(storage._cdata) > ours
        if viewed or pool is not None:  # the old storage is left to them, or pooled
            if not viewed:
                pool.give(self.full, self._attached)
            self.full = self._take_spare()
            return True
        storage.resize_(0)
        return False

    def _take_spare(self):
        """A `full` without bytes for a unit whose storage went elsewhere:
        the one kept from the last such release if it has none still (a
        gather from the pool leaves it unused; one grown in place is `full`
        itself, and goes), else a new one (two torch calls, 8 us a release
        in stage3_overhead.py)."""
        spare = self._spare
        if spare is None or spare.untyped_storage().nbytes() != 0:
            spare = torch.empty(self.total, dtype=self.full.dtype, device=self.full.device)
            spare.untyped_storage().resize_(0)
        self._spare = spare
        return spare

    def reserve(self, pool=None):
        """Storage for a gather into `full`: the same storage object grown
        again, or a pooled buffer of this size ([Note: gather pool]), whose
        storage then replaces it: returns the key `full` had, else None."""
        nbytes = self.total * self.full.element_size()
        if self.full.untyped_storage().nbytes() == nbytes:
            return None
        taken = pool.take(self.total, self.full.dtype) if pool is not None else None
        if taken is None:
            self.full.untyped_storage().resize_(nbytes)
            return None
        old_key = storage_key(self.full)
        self.full = taken
        self._attached = pool.attached_views(taken)
        self._views = self._attached.get(self._layout)
        return old_key


class GatherPool:
    """[Note: gather pool] On the CPU, a released unit's buffer freed back
    to the allocator returns to the kernel (glibc unmaps large blocks), and
    the next gather's buffer is faulted in page by page: measured, most of
    a stage-3 generation's time unit by unit (docs/performance.md,
    "ZeRO-Inference"). So Stage3Schedule keeps released buffers here and a
    gather of the same size takes one back. It holds a buffer only while
    the gathered units and the pool together stay within the peak gathered
    so far (`fits` at a release, `trim` after a gather), so
    memory_summary's gathered_peak still bounds what gathering holds. A
    buffer some other tensor still views is never pooled ([Note: released
    parameters]). On a GPU torch's caching allocator already reuses
    blocks: no pool."""

    def __init__(self):
        self.free = {}   # (elements, dtype) -> [tensor]
        self.attached = {}  # id(tensor) -> its parameter views, while pooled
        self.nbytes = 0

    def fits(self, room: int, unit) -> bool:
        return self.nbytes + unit.total * unit.full.element_size() <= room

    def give(self, t, attached=None):
        """Keep buffer t, with the parameter views made of it ([Note:
        parameter views] in Unit)."""
        self.free.setdefault((t.numel(), t.dtype), []).append(t)
        self.nbytes += t.nbytes
        self.attached[id(t)] = attached or {}

    def attached_views(self, t) -> dict:
        """The views that came with t (a buffer just taken)."""
        return self.attached.pop(id(t), {})

    def trim(self, room: int):
        """Free pooled buffers (the largest first) until they fit in `room` bytes."""
        while self.nbytes > room:
            key = max((k for k, kept in self.free.items() if kept),
                      key=lambda k: k[0] * k[1].itemsize)
            t = self.free[key].pop()
            self.attached.pop(id(t), None)
            self.nbytes -= t.nbytes

    def take(self, numel, dtype):
        kept = self.free.get((numel, dtype))
        if not kept:
            return None
        t = kept.pop()
        self.nbytes -= t.nbytes
        return t


def units_of_params(params, place) -> list:
    """The (group, unit) entries of `params` in `place` (id(parameter) ->
    (group, unit), Stage3Schedule's), each unit once, in the order its
    first parameter comes; None and parameters not in place skipped."""
    needed, seen = [], set()
    for p in params:
        entry = place.get(id(p)) if p is not None else None
        if entry is not None and id(entry[1]) not in seen:
            seen.add(id(entry[1]))
            needed.append(entry)
    return needed


def lay_out(params, unit_sizes, num_partitions) -> list:
    """The units of a flat group whose params are in unit order: unit k
    takes the next unit_sizes[k] of them; each unit's chunk follows the
    last in a rank's partition, and its whole layout in the unsharded one.
    Shared by FlatGroup and zero.estimate_memory, which must agree."""
    units, first, shard_at, layout_at = [], 0, 0, 0
    for size in unit_sizes:
        members = range(first, first + size)
        unit = Unit(len(units), members, [params[i] for i in members], num_partitions,
                    shard_at, layout_at)
        units.append(unit)
        first += size
        shard_at += unit.part
        layout_at += unit.total
    return units


class PersistenceBudget:
    """[Note: persistence] At stage 3 a unit of at most `threshold`
    elements (stage3_param_persistence_threshold) is gathered for good
    instead of per use, as long as the persistent elements stay within
    `cap` in all (stage3_model_persistence_threshold; None: no cap), the
    units taken in layout order, group by group. Shared by Stage3Schedule
    and zero.estimate_memory, which must agree.
    A unit holding a parameter its module writes in its own forward
    (written_in_forward) is gathered for good whatever its size: a release
    after that forward would drop the write, which a kept unit takes in
    at the step as any other write ([Note: parameter writes])."""

    def __init__(self, threshold: int, cap=None, written=frozenset()):
        self.threshold, self.left, self.written = threshold, cap, written

    @classmethod
    def of(cls, config, model) -> "PersistenceBudget":
        """The budget `config`'s thresholds give for training `model`."""
        return cls(config.stage3_param_persistence_threshold,
                   config.stage3_model_persistence_threshold, written_in_forward(model))

    def takes(self, unit) -> bool:
        if any(id(p) in self.written for p in unit.params):
            return True
        if unit.numel > self.threshold:
            return False
        if self.left is not None:
            if unit.numel > self.left:
                return False
            self.left -= unit.numel
        return True


def written_in_forward(model) -> frozenset:
    """The ids of the parameters `model`'s modules write in place in their
    own forward: the weight of an nn.Embedding or nn.EmbeddingBag with
    max_norm, whose looked-up rows torch renormalizes in place."""
    return frozenset(id(m.weight) for m in model.modules()
                     if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and
                     m.max_norm is not None)


def storage_key(t):
    """The identity of a tensor's storage, the same after the storage is
    resized (a unit released and gathered again), or None for a tensor
    without one (sparse, some subclasses)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def uncompiled(module):
    """The model inside torch.compile's wrapper (an OptimizedModule), else
    the module: the names checkpoints keep are the model's (the wrapper's
    add '_orig_mod.', so a checkpoint saved after `engine.module =
    torch.compile(engine.module)` named every parameter apart from the
    engine's and could not be read back)."""
    inner = module._modules.get("_orig_mod") if type(module).__name__ == "OptimizedModule" \
        else None
    return inner if isinstance(inner, torch.nn.Module) else module


def parameter_names(module) -> dict:
    """id(parameter) -> its name in the module (seen through torch.compile's
    wrapper); a tied parameter goes by the name it is first registered
    under, as named_parameters gives it."""
    names = {}
    for name, p in uncompiled(module).named_parameters():
        names.setdefault(id(p), name)
    return names


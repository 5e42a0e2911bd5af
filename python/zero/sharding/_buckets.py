"""The bucket reducer of a flat group at stages 2-3: which bucket each
gradient lands in, when a bucket leaves, and how its reduced portion comes
back into this rank's gradient partition.

- Buckets are fixed ranges of units, numbered from the last unit's end (the
  order backward produces gradients) and always reduced in that order, so
  every rank issues the same collectives in the same order even when some
  parameters get no gradient on some rank (their part of a bucket is zero).
- [Note: rank-local gradients] A bucket leaves when its expected gradients
  are in ([Note: expected gradients]), which is rank-local: a parameter used
  on one rank only (a data-dependent branch) has its bucket leave
  mid-backward there and at the end of backward on the other. So
  - each group reduces on a channel of its own ([Note: reduction channels]
    in _comm.py), apart from the other groups' buckets and stage 3's
    all-gathers: only the order of a group's own buckets must match, and it
    is fixed (the small groups' buckets on gloo wait for the end of the
    backward and go together: [Note: small groups' buckets]);
  - a parameter that got a gradient on some ranks but not all is never
    expected again, so the ranks launch their buckets at the same points
    once more;
  - until then a rank must not wait long for a bucket: its peer may be
    waiting for this rank's next all-gather, or another group's bucket.
    Backward keeps MAX_IN_FLIGHT buckets in flight and waits for the oldest
    beyond that, but at most STALL_SECONDS; then it stops waiting for the
    rest of that backward (more buckets held, never a hang). Waiting
    matters: without it, on gloo, the whole gradient would sit in buckets
    (the memory figures' `buckets` counts them).
"""
from __future__ import annotations

import time

import torch

from zero._C import GradBuckets as _GradBuckets
from zero.comm._comm import group_backend
from zero.comm._reduce_together import reduce_together

# Buckets whose reduction may still be running while backward fills the
# next: two let communication overlap computation without holding more.
MAX_IN_FLIGHT = 2
# the longest backward waits for a bucket before it stops waiting for the
# rest of that backward ([Note: rank-local gradients]); far above a
# bucket's reduction time (25 MB at 1 GB/s: 25 ms)
STALL_SECONDS = 1.0


class BucketReducer:
    """The gradient buckets of one flat group (stages 2-3): filled from the
    post-accumulate-grad hooks as backward produces gradients, reduced to
    their owners as they fill, and collected into the group's gradient
    partition (fg.grad_part).

    The plan (which piece of which gradient lands where), the counts and
    the hook itself are C ([Note: the hook in C] in csrc/module_buckets.c;
    [Note: the bucket plan] in csrc/zero.h); this class makes the buffers,
    launches the reductions and collects them."""

    def __init__(self, fg, bucket_elements, reduction="reduce"):
        self.fg = fg
        self.scatter = _scatters(fg, reduction)
        self._gloo = None  # whether the buckets' device goes by gloo (known at the first launch)
        units, offsets, numels = [], [], []
        for i in range(len(fg.params)):
            unit = fg.unit_of[i]
            j = i - unit.members.start
            units.append(unit.index)
            offsets.append(unit.offsets[j])
            numels.append(unit.numels[j])
        # [Note: bucket reduction] a unit that fits in a bucket is one
        # bucket over its whole padded layout (total, not span) when
        # reducing by reduce_scatter: the bucket is then the world's chunks
        # of equal size, and one reduce_scatter gives each rank its own
        spans = [u.total if self.scatter and u.total <= bucket_elements else u.span
                 for u in fg.units]
        # [Note: small units share a bucket] in csrc/zero.h: consecutive
        # units whose chunks fit share one bucket, rank-major
        self.core = _GradBuckets(units, offsets, numels, spans,
                                 bucket_elements, owner=self, dtype=fg.compute_dtype,
                                 tensor_type=torch.Tensor, strided=torch.strided,
                                 unit_parts=[u.part for u in fg.units],
                                 chunks=fg.num_partitions)
        # (unit, start, end) in unit coordinates (0 = the last unit's end),
        # or (first unit, 0, size) of a shared bucket; shared[b]: the units
        # a shared bucket holds, lowest first
        self.buckets, self.shared = [], {}
        for b in range(self.core.count):
            u, start, end = self.core.bucket(b)
            self.buckets.append((fg.units[u], start, end))
            first, last = self.core.bucket_units(b)
            if last > first:
                self.shared[b] = fg.units[first:last + 1]
        self.on_unit_grads_done = None  # stage 3 releases the unit then
        # [Note: expected gradients] A bucket leaves once every parameter
        # *expected* to get a gradient has one. At first all are expected;
        # after each backward, those that got one on some rank (agreed by a
        # small all-reduce, so every rank expects the same). A parameter
        # unused on a step (a pooler under masked-LM training) then does
        # not hold back every bucket after it until the end of backward.
        # A unit waits for the end of the backward when one of its
        # parameters is not expected: autograd may still read that
        # parameter after the others' gradients are in, and not every read
        # goes through stage 3's saved-tensor hook (activation
        # checkpointing keeps its own).
        self.expected = bytearray(b"\x01" * len(self.fg.params))
        self.never_expected = ()  # see never_expect
        self.in_flight = []
        self.stalls = 0  # backwards that stopped waiting ([Note: rank-local gradients])
        self.live_elements = 0  # the buckets filling and in flight
        self.on_backward_began = None  # the engine's backward lifecycle
        # this backward's buckets, held for reduce_deferred; None: each
        # bucket reduced when it leaves ([Note: small groups' buckets])
        self.deferred = None
        self.reset_buckets()
        self.peak_bucket_bytes = 0

    def hook(self, i):
        """Parameter i's post-accumulate-grad hook (a C callable)."""
        return self.core.hook(i)

    def detach(self):
        """The hooks do nothing from now on (the engine closed)."""
        self.core.detach()

    def never_expect(self, indices):
        """Parameters whose gradients come or not depending on the rank's
        data (stage 3 leaf modules: the experts of a mixture). No bucket
        waits for them, so every rank launches its reductions at the same
        points of the backward, whichever experts its tokens chose; their
        gradients join the bucket while it is open, else a late one."""
        self.never_expected = tuple(indices)
        for i in self.never_expected:
            self.expected[i] = 0
        self.reset_buckets()

    def reset_buckets(self):
        self.core.reset(bytes(self.expected))
        self.spare = None  # [Note: a spare bucket]: within one backward only
        # what is still in flight (none but after an abandoned backward)
        self.live_elements = sum(f[1].numel() for f in self.in_flight)
        self.stalled = False  # see _wait_a_while

    # ---- called by the C hook ------------------------------------------------

    def _new_bucket(self, b, late):
        _unit, bs, be = self.buckets[b]
        if not late:
            # the buckets filling and in flight (a running count: summing
            # them at each new bucket cost a walk of all of them)
            self.live_elements += be - bs
            self.peak_bucket_bytes = max(self.peak_bucket_bytes,
                                         self.live_elements * self.fg.compute_dtype.itemsize)
        return self._bucket_buffer(be - bs)

    def _bucket_buffer(self, n):
        # in the compute dtype, whatever the partition accumulates in:
        # what travels is what backward produced. Not zeroed: the core
        # copies each first piece and zeroes the rest at the send
        # ([Note: no zero-fill] in csrc/buckets.c)
        spare, self.spare = self.spare, None
        if spare is not None and spare.numel() == n:
            return spare
        return torch.empty(n, dtype=self.fg.compute_dtype, device=self.fg.device)

    # [Note: a spare bucket] On the CPU a freed bucket goes back to the
    # kernel (glibc maps blocks over 32 MiB, and smaller ones under a
    # pinned MALLOC_MMAP_THRESHOLD_) and the next is faulted in page by
    # page: 2.5 ms a 6 MiB bucket in bench/train.py's stage 3, a tenth of
    # its backward's overhead. So the last bucket retired is kept for the
    # next of the same size within a backward. Never more held than
    # without it: a bucket of another size drops it before allocating, and
    # the end of the backward drops it. (A GPU's caching allocator already
    # reuses blocks.)
    def _keep_spare(self, staging):
        if staging.device.type == "cpu":
            self.spare = staging

    def _send_bucket(self, b, staging):
        self._launch(b, staging)

    def _add_piece(self, grad, bucket, bucket_start, grad_start, count, first):
        """A piece the C hook does not write itself (a GPU tensor, another
        dtype, a non-contiguous gradient): one copy_ when it is the first
        there this backward, else one add_."""
        if grad.layout != torch.strided:
            raise self._sparse_error(grad)
        piece = grad.reshape(-1)[grad_start:grad_start + count]
        target = bucket[bucket_start:bucket_start + count]
        if first:
            target.copy_(piece)
        else:
            target.add_(piece)

    def _sparse_error(self, grad) -> RuntimeError:
        """A sparse gradient reached a bucket: from F.embedding(...,
        sparse=True) in a forward, which initialize cannot see (it refuses
        sparse nn.Embedding modules by name)."""
        name = next((self.fg.names[i] for i, p in enumerate(self.fg.params)
                     if p.grad is grad), None)
        which = f"parameter '{name}'" if name else "a parameter"
        return RuntimeError(
            f"zero: {which} got a {grad.layout} gradient (F.embedding or F.embedding_bag "
            "with sparse=True); stages 2-3 reduce gradients in dense buckets, so pass "
            "sparse=False, or train at stage 0 or 1")

    def _zero_range(self, bucket, start, count):
        """A range of a bucket no piece wrote, where the C hook cannot reach
        the bucket (a GPU's). One zero_ a range: parameters start at
        multiples of 64 elements (PARAM_ALIGN) and models' widths mostly
        are such multiples, so the ranges are mostly a unit's padding at
        its end, about one a bucket: as many launches as the torch.zeros a
        bucket took before ([Note: no zero-fill] in csrc/buckets.c)."""
        bucket[start:start + count].zero_()

    def _unit_arrived(self, unit_index):
        if self.on_unit_grads_done is not None:
            self.on_unit_grads_done(self.fg.units[unit_index])

    def _backward_began(self):
        if self.on_backward_began is not None:
            self.on_backward_began()

    def _launch(self, b, staging, late=False):
        unit, bs, be = self.buckets[b]
        if late:
            self.live_elements += staging.numel()
        if self.deferred is not None:
            self.deferred.append((b, staging))
            return
        if self.scatter and (b in self.shared or (bs == 0 and be == unit.total)) and \
                self.fg.comm.world > 1:
            # whole units (shared, or one unit's whole padded layout)
            works, mine = self._scatter_whole_units(self.shared.get(b, [unit]), staging)
        else:
            works, mine = [], None
            for r, portion, at in self.pieces(b, staging):
                works.append(self.fg.reduce_comm.reduce_sum(portion, dst=r, async_op=True))
                if at is not None:
                    mine = (portion, at)
        self.in_flight.append((works, staging, mine))
        self._retire(wait=False)

    def pieces(self, b, staging) -> list:
        """Bucket b (its buffer `staging`) by destination rank, in rank
        order: (rank, portion, where the portion lands in this rank's
        partition, or None on the other ranks). A bucket of whole units
        ([Note: small units share a bucket] in csrc/zero.h) is laid out
        rank-major: segment r is chunk r of each unit, lowest first, one
        range of rank r's partition from the first unit's chunk. A range
        of a unit splits at its chunks' ends."""
        unit, bs, be = self.buckets[b]
        rank = self.fg.comm.rank
        if b in self.shared:
            world = self.fg.num_partitions
            segment = staging.numel() // world
            at = self.shared[b][0].shard_offset
            return [(r, staging[r * segment:(r + 1) * segment], at if r == rank else None)
                    for r in range(world)]
        out = []
        r = bs // unit.part
        while r * unit.part < be:
            lo, hi = max(bs, r * unit.part), min(be, (r + 1) * unit.part)
            at = unit.shard_offset + lo - r * unit.part
            out.append((r, staging[lo - bs:hi - bs], at if r == rank else None))
            r += 1
        return out

    def _on_gloo(self, comm, staging) -> bool:
        """Whether the buckets' device goes by gloo on comm's group (known
        at the first launch, then kept)."""
        if self._gloo is None:
            self._gloo = _backend_for(group_backend(comm.group), staging.device) == "gloo"
        return self._gloo

    def _scatter_whole_units(self, units, staging):
        """A bucket of whole units (pieces()' rank-major form) reduced by
        scatter: one reduce-scatter (NCCL), or one all-reduce on gloo."""
        fg = self.fg
        world, rank = fg.num_partitions, fg.owner
        segment = staging.numel() // world
        at = units[0].shard_offset
        comm = fg.reduce_comm
        if self._on_gloo(comm, staging):
            # gloo's reduce_scatter is an all-reduce inside, and its
            # handle never reports done until waited on, so every
            # backward waited STALL_SECONDS for it: the all-reduce
            # itself, this rank's segment kept (as fast or faster on
            # gloo: docs/performance.md, "The bucket reduction on gloo")
            mine = staging[rank * segment:(rank + 1) * segment]
            return [comm.all_reduce_sum(staging, async_op=True)], (mine, at)
        portion = staging.new_empty(segment)
        return [comm.reduce_scatter_sum(portion, staging, async_op=True)], (portion, at)

    def _retire(self, wait):
        """Add this rank's reduced portions of the buckets in flight into its
        gradient partition, oldest first (the same order every time, so the
        same bits); their staging memory is then free. All of them when
        `wait`; else the complete ones, waiting (a while: [Note: rank-local
        gradients]) only while more than MAX_IN_FLIGHT are left."""
        while self.in_flight:
            works, staging, mine = self.in_flight[0]
            if not wait and not _complete(works) and \
                    (len(self.in_flight) <= MAX_IN_FLIGHT or not self._wait_a_while(works)):
                return
            self.in_flight.pop(0)
            self.live_elements -= staging.numel()
            for w in works:
                if w is not None:
                    w.wait()
            if mine is not None:
                portion, off = mine
                part = self.fg.grad_part
                # a partition on the host ([Note: parameters off the
                # device] in _param_staging.py): the portion goes there first
                part[off:off + portion.numel()].add_(portion.to(part.device))
            self._keep_spare(staging)

    def _wait_a_while(self, works) -> bool:
        """True once `works` are complete; False after STALL_SECONDS, and
        from then on until this backward ends."""
        if self.stalled:
            return False
        deadline = time.monotonic() + STALL_SECONDS
        pause = 1e-5
        while not _complete(works):
            if time.monotonic() > deadline:
                self.stalled = True
                self.stalls += 1
                return False
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        return True

    def _send_rest(self) -> list:
        """The first half of a backward's end (finish_backwards): what is
        left sent, and this rank's flags: per parameter whether it got a
        gradient, then per bucket whether it got a late one."""
        self.core.send_rest()
        late = set(self.core.late_buckets())
        return list(self.core.arrived()) + [int(b in late) for b in range(len(self.buckets))]

    def _finish(self, flags):
        """The second half, given the flags summed over the ranks."""
        for b in range(len(self.buckets)):
            if flags[len(self.fg.params) + b]:
                buffer = self.core.take_late(b)
                if buffer is None:  # late elsewhere only: zeros from here
                    _unit, bs, be = self.buckets[b]
                    buffer = self._bucket_buffer(be - bs).zero_()
                self._launch(b, buffer, late=True)
        self._retire(wait=True)
        counts = flags[:len(self.fg.params)]
        world = self.fg.comm.world
        rank_local = [i for i, n in enumerate(counts) if 0 < n < world]
        if rank_local:  # [Note: rank-local gradients]
            self.never_expected = tuple(sorted(set(self.never_expected) | set(rank_local)))
        self.expected = bytearray(1 if n else 0 for n in counts)
        for i in self.never_expected:
            self.expected[i] = 0
        self.reset_buckets()
        self.fg.reduced_since_step = True

    def abandon_backward(self):
        """Forget a backward that raised: wait for the reductions already
        issued (a collective cannot be taken back) and drop the rest: a
        .grad the C hook had not taken yet too (a backward interrupted
        inside its call back into Python), which the next backward would
        add to."""
        self._retire(wait=True)
        if self.deferred:
            self.deferred = []
        self.reset_buckets()
        for p in self.fg.params:
            p.grad = None

    @property
    def backward_started(self):
        return self.core.started

    # ---- after the step ------------------------------------------------------


def finish_backwards(reducers, serial=None, boundary=None):
    """End of a backward for each of `reducers`: reduce what is left, in
    order; agree with the other ranks on which parameters got gradients
    and which buckets got late gradients; reduce the late buckets (zeros
    where this rank has none), in order; collect. The flags are agreed in
    one all-reduce per Comm rather than one a group:
    a model with many param groups paid one a group at every backward
    ([Note: small groups reduced together] in comm/_reduce_together.py).
    Every group sends what is left before the agreement, so each group's
    channel sees its collectives in the order it did with one group.
    serial: the engine's (Engine.serial), and boundary: whether its next
    step() updates, both agreed in the same all-reduce ([Note: one
    engine's backward end])."""
    flags = [r._send_rest() for r in reducers]
    by_comm = {}
    for k, r in enumerate(reducers):
        if r.fg.comm.world > 1:
            by_comm.setdefault(id(r.fg.comm), []).append(k)
    for ks in by_comm.values():
        comm = reducers[ks[0]].fg.comm
        # host numbers: on the CPU (gloo) where the group allows, so
        # reading them back does not wait for the GPU
        # [Note: one engine's backward end] the engine's serial and whether
        # its next step updates ride along, each with its square:
        # - the reductions of two engines over the same ranks share
        #   channels, and ranks that ran two engines' backwards in other
        #   orders paired one engine's reductions with the other's, mixing
        #   both models' gradients silently at stage 2;
        # - a rank whose step updates (set_gradient_accumulation_boundary
        #   on that rank alone) went into the update's collectives while
        #   the others went on into the next backward's reductions: gloo
        #   aborted the processes without a word.
        # The sums say whether every rank gave the same value (world x the
        # sum of squares equals the squared sum only then)
        agreed = ([] if serial is None else [serial + 1]) + \
            ([] if boundary is None else [int(boundary) + 1])
        tail = [v for value in agreed for v in (value, value * value)]
        joined = torch.tensor([f for k in ks for f in flags[k]] + tail, dtype=torch.int32,
                              device=comm.scalar_device)
        comm.all_reduce_sum(joined)
        joined, at = joined.tolist(), 0
        sums = joined[len(joined) - len(tail):]
        alike = [comm.world * sums[2 * j + 1] == sums[2 * j] ** 2 for j in range(len(agreed))]
        if serial is not None and not alike[0]:
            raise RuntimeError(
                "zero: the ranks ended the backwards of two engines in other orders (this "
                "rank's was engine " f"{serial}'s), so their gradient reductions paired with "
                "each other's: both engines' gradients are mixed. Run the engines' "
                "backwards in one order on every rank; call zero_grad() on both before "
                "going on")
        if boundary is not None and not alike[-1]:
            raise RuntimeError(
                "zero: the ranks disagree on whether the coming step() updates (on this rank "
                f"it {'does' if boundary else 'does not'}): set_gradient_accumulation_boundary() "
                "was called on some ranks only, or with other values, or the ranks count "
                "other micro-steps. Its update's collectives would have met the other ranks' "
                "next backward. Call it alike on every rank (with uneven data, agree on the "
                "last batch first); call zero_grad() before going on")
        for k in ks:
            flags[k], at = joined[at:at + len(flags[k])], at + len(flags[k])
    for r, f in zip(reducers, flags):
        r._finish(f)
    reduce_deferred(reducers)


def reduce_deferred(reducers):
    """[Note: small groups' buckets] On gloo a bucket's reduction costs its
    latency when small (about 0.5 ms a collective on 2 CPU ranks), and
    each param group has buckets of its own: a model with a group or two a
    layer (layer-wise learning rates) reduced some 55 buckets a step where
    two groups reduce 4. So the buckets of the small groups
    (ReductionChannels in _groups_together.py says which) are held to the
    end of the backward and reduced together here, one reduce per rank for
    all of them, after every group's own reductions, on the one channel
    those groups share (40 small groups open one process group, not 40):
    the same point and order on every rank (every bucket of a group leaves
    in every backward, and the late ones are agreed). Each element's sum
    is over the same ranks: bit for bit a reduction a bucket on 2 ranks,
    within rounding of it on more ([Note: small groups reduced together]
    in comm/_reduce_together.py)."""
    held = [(red, b, staging) for red in reducers if red.deferred for b, staging in red.deferred]
    if not held:
        return
    comm = held[0][0].fg.reduce_comm
    for dst in range(comm.world):
        portions, mine = [], []
        for red, b, staging in held:
            for r, portion, at in red.pieces(b, staging):
                if r == dst:
                    portions.append(portion)
                    if at is not None:
                        mine.append((red.fg, portion, at))
        reduce_together(comm, portions, dst)
        for fg, portion, at in mine:
            part = fg.grad_part  # on the host where the partition is
            part[at:at + portion.numel()].add_(portion.to(part.device))
    for red in reducers:
        if red.deferred:
            red.deferred = []  # (no longer counted live: _finish's reset_buckets)


def _complete(works) -> bool:
    return all(w is None or w.is_completed() for w in works)


def _backend_for(backends: str, device) -> str:
    """The backend of a group's (group_backend's answer) for `device`."""
    if ":" not in backends:
        return backends
    by_device = dict(item.split(":", 1) for item in backends.split(","))
    return by_device.get(device.type, "")


def _scatters(fg, reduction) -> bool:
    """Whether the group's buckets go by reduce_scatter ([Note: bucket
    reduction]): asked for, or "auto" on NCCL. On gloo a reduce per
    destination measured faster (docs/performance.md, "The bucket
    reduction on gloo"): gloo's reduce_scatter is an all-reduce inside."""
    if reduction != "auto":
        return reduction == "reduce_scatter"
    comm = fg.reduce_comm
    if comm is None or comm.world == 1 or fg.device.type != "cuda":
        return False
    return "nccl" in group_backend(comm.group)

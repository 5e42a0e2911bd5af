"""One param group's parameters, laid out flat and partitioned over the
data-parallel ranks: the single sharding mechanism of every stage.

[Note: flat group layout]
- The group's parameters are split into units (_units.Unit): the whole group
  is one unit at stages 0-2; at stage 3 each module's own parameters form a
  unit. A unit's `full` buffer holds its parameters in the compute dtype,
  padded to num_partitions * unit.part elements; the parameters are views
  into it while the unit is gathered.
- Rank r owns chunk r of every unit. The rank's partition (`shard`,
  `master`, the optimizer states and `grad_part`) is the concatenation of
  its chunks, unit by unit, so the C optimizer runs over one contiguous
  range per group. Stage 0 has one partition: the whole buffer.
- At stages 0-2 the single unit stays gathered and `shard` is a view of its
  `full` buffer, so the optimizer's copy-out lands in the parameters
  directly. At stage 3 `shard` is its own buffer and units are gathered
  from it on demand (_stage3.py) and released after use.
- Gradients: stages 0-1 keep a full flat gradient buffer that backward
  accumulates into in place (.grad are views of it), reduced at the
  accumulation boundary; stages 2-3 keep only the owned chunks (`grad_part`)
  and reduce fixed buckets from post-accumulate-grad hooks while backward
  runs.
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
    is fixed;
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

import os
import time

import torch

import zero._C as _C
from zero.sharding._partitioned_init import take_values
from zero.sharding._units import Unit, lay_out

# Buckets whose reduction may still be running while backward fills the
# next: two let communication overlap computation without holding more.
MAX_IN_FLIGHT = 2
# the longest backward waits for a bucket before it stops waiting for the
# rest of that backward ([Note: rank-local gradients]); far above a
# bucket's reduction time (25 MB at 1 GB/s: 25 ms)
STALL_SECONDS = 1.0

# how far around a faulting page Linux maps a file's pages in (its default
# fault_around_bytes)
FAULT_AROUND_BYTES = 64 << 10

# gather_master's slice per rank on a GPU (16M fp32 elements: 64 MiB a rank)
GATHER_SLICE = 1 << 24
STAGING_CHUNK = 1 << 22  # elements a staged step moves between device and host at a time


class FlatGroup:
    def __init__(self, index, params, names, compute_dtype, comm, stage, bucket_elements,
                 units=None, trainable=True, device=torch.device("cpu"), grad_dtype=None,
                 offload=None, staged=False, reduce_comm=None, param_files=None):
        """units: lists of indices into params, one list per unit (stage 3);
        None makes the whole group one unit. The params are reordered unit
        by unit. trainable=False (stage 3's frozen parameters) keeps no
        master, gradients or optimizer states. Every buffer lives on
        `device`, the model's. grad_dtype: the gradient partition's dtype
        at stages 2-3 (default the compute dtype; buckets stay in it).
        offload: a _nvme.NvmeFiles that holds the fp32 master (where it is
        not the parameters) and the optimizer states in files.
        staged: the master and the states live in host memory apart from
        the model (a GPU model under offload_optimizer), and the step stages
        gradients and parameters through small host windows ([Note: staged
        step] in _step_path.py).
        reduce_comm: the channel the gradient buckets are reduced on
        (stages 2-3; [Note: reduction channels] in _comm.py); default comm.
        param_files: a _nvme.NvmeFiles that holds stage 3's shard of the
        parameters (offload_param "nvme"): see [Note: shard on a disk]."""
        if units is None:
            units = [list(range(len(params)))]
        order = [i for members in units for i in members]
        self.index = index
        self.params = [params[i] for i in order]
        self.names = [names[i] for i in order]
        self.comm = comm
        self.reduce_comm = reduce_comm or comm
        self.stage = stage
        self.trainable = trainable
        self.compute_dtype = compute_dtype
        self.device = device
        self.staged = staged
        self.state_device = torch.device("cpu") if staged else device
        self.offload = offload if trainable else None
        self.param_files = param_files
        self.num_partitions = 1 if stage == 0 else comm.world
        self.numel = sum(p.numel() for p in self.params)  # Ψ of this group
        self.owner = 0 if stage == 0 else comm.rank
        self.units: list[Unit] = lay_out(self.params, [len(m) for m in units],
                                         self.num_partitions)
        self.unit_of = []      # param index -> its unit
        self.layout_start = []  # param index -> offset in the unsharded layout
        for unit in self.units:
            for j in range(len(unit.members)):
                self.unit_of.append(unit)
                self.layout_start.append(unit.layout_offset + unit.offsets[j])
        self.part_size = sum(u.part for u in self.units)     # this rank's partition
        self.layout_size = sum(u.total for u in self.units)  # the unsharded layout
        self._build_buffers(compute_dtype)
        self.states: dict[str, torch.Tensor] = {}
        # updates made (SGD: those that used the momentum buffer; see
        # counts_as_step in step/_registry.py)
        self.step_count = 0
        self.reduced_since_step = False
        self.accumulate_by_hook = False
        if not trainable:
            return
        if stage <= 1:
            grad_dtype = grad_dtype or compute_dtype
            self.grad_flat = torch.zeros(self.units[0].total, dtype=grad_dtype, device=device)
            lo = self.owner * self.units[0].part
            self.grad_part = self.grad_flat[lo:lo + self.part_size]
            # .grad must have the parameter's dtype: a wider buffer is
            # filled from hooks (accumulate_grad) instead of by autograd
            self.accumulate_by_hook = grad_dtype != compute_dtype
            self.point_grads_at_flat()
        else:
            self.grad_flat = None
            self.grad_part = torch.zeros(self.part_size, dtype=grad_dtype or compute_dtype,
                                         device=device)
            self._plan_buckets(bucket_elements)
        self.tensors["grad"] = self.grad_part
        self._register("grad", self.grad_part)
        if self.staged:
            # page-locked windows the step stages a chunk of the gradients
            # in and of the rounded parameters out through; chunk-sized, so
            # locked memory stays small (torch also rounds a page-locked
            # block up to a power of two)
            chunk = offload.chunk if self.offload is not None else STAGING_CHUNK
            self.staging_chunk = max(1, min(chunk, self.part_size))
            self.host_windows = {"grad": self._host_buffer(self.grad_part.dtype),
                                 "copy_out": self._host_buffer(compute_dtype)}

    def _build_buffers(self, compute_dtype):
        """Seed the shard (and fp32 master) from the parameters' values on
        rank 0, one unit at a time, so no rank holds more than the model
        itself plus one unit in fp32."""
        fp32 = compute_dtype == torch.float32
        releasing = self.stage == 3
        # the master is the parameters themselves only in fp32 with both on
        # one device; an offloaded master is written straight into its
        # file, so RAM never holds a second copy of this rank's partition
        own_master = not fp32 or self.staged
        master_file = None
        if self.offload is not None and own_master:
            master_file = self.offload.create("master", self.part_size)
        if releasing:
            self.shard = self.param_files.create("shard", self.part_size, dtype=compute_dtype) \
                if self.param_files is not None else \
                torch.empty(self.part_size, dtype=compute_dtype, device=self.device)
            self.master = None
            if self.trainable:
                self.master = self.shard if not own_master else master_file \
                    if master_file is not None else \
                    torch.empty(self.part_size, dtype=torch.float32, device=self.state_device)
        for unit in self.units:
            full32 = torch.zeros(unit.total, dtype=torch.float32, device=self.device)
            for j, p in enumerate(unit.params):
                # a partitioned_init placeholder is gathered here, one
                # parameter at a time, and its chunk freed
                full32[unit.offsets[j]:unit.offsets[j] + unit.numels[j]].copy_(
                    take_values(p).reshape(-1))
            self.comm.everyone.broadcast(full32, src=0)  # the replicas too
            mine = unit.chunk(full32, self.owner)
            if releasing:
                self.shard[unit.shard_slice].copy_(mine)
                if self.master is not None and own_master:
                    self.master[unit.shard_slice].copy_(mine)
                    if master_file is not None:
                        self.offload.drop("master", unit.shard_slice.start,
                                          unit.shard_slice.stop)
                self.drop_param_pages(unit.shard_slice)
                unit.full = torch.empty(unit.total, dtype=compute_dtype, device=self.device)
                unit.release()
            else:
                # stages 0-2: the single unit stays gathered for good
                unit.full = full32 if fp32 else full32.to(compute_dtype)
                self.shard = unit.chunk(unit.full, self.owner)
                if not own_master:
                    self.master = self.shard
                elif master_file is not None:
                    self.master = self.offload.write("master", master_file, mine)
                else:
                    self.master = mine.to(self.state_device, torch.float32, copy=True)
                unit.gathered = unit.persistent = True
                unit.point_params()
            del full32, mine
        # the update's operands as tensors (the GPU step), and on the CPU
        # also registered with the C core once, so a step passes no DLPack
        self.buffers, self.tensors, self._registered_at = {}, {}, {}
        if self.trainable:
            self.tensors["master"] = self.master
            self.tensors["copy_out"] = None if self.master is self.shard else self.shard
            for k, t in self.tensors.items():
                self._register(k, t)

    # ---- layout helpers --------------------------------------------------

    def view(self, layout, i):
        """Parameter i's elements in a tensor of the unsharded layout."""
        unit = self.unit_of[i]
        j = i - unit.members.start
        off = self.layout_start[i]
        return layout[off:off + unit.numels[j]].view(unit.shapes[j])

    def add_state(self, name, fill=0.0):
        if name not in self.states:
            if self.offload is not None:
                t = self.offload.create(name, self.part_size, fill)
            else:
                t = torch.full((self.part_size,), fill, dtype=torch.float32,
                               device=self.state_device)
            self.states[name] = t
            self.tensors[name] = t
            self._register(name, t)

    def release_offloaded(self):
        """Stop holding offloaded states (and an offloaded shard) in RAM
        after something read or wrote them whole (a checkpoint,
        full_state_dict, the step)."""
        if self.offload is not None:
            self.offload.drop()
        self.drop_param_pages()

    def check_shard_writable(self):
        """A forked child shares an offloaded shard's file with its parent
        (memory would be copied on write): its writes would change the
        parent's parameters, so they are refused."""
        if self.param_files is not None and self.param_files.pid != os.getpid():
            raise RuntimeError("offload_param: a forked child cannot write the parent's "
                               "parameters, whose shard is a file they share; build an engine "
                               "in the child")

    def drop_param_pages(self, span: slice | None = None):
        """[Note: shard on a disk] With offload_param "nvme" the shard is a
        file mapped into memory: a gather reads the unit's chunk through the
        mapping and the step writes the new values through it, so those
        pages become resident; they are dropped again (unmapped from the
        process; the kernel keeps or writes back the page cache) once the
        unit is gathered, after each chunk of the step, and after
        whole-shard reads and writes, so the process holds only the chunk
        in use. span: the shard's elements used (a unit's shard_slice, a
        step's chunk); None: the whole shard."""
        if self.param_files is None or "shard" not in self.param_files.maps:
            return  # in memory, or no file for a group without elements
        if span is None:
            self.param_files.drop()
        else:
            # a read through a file mapping maps the pages around the one
            # it faults in too (the kernel's fault-around, 64 KiB): those
            # of the neighbouring chunks go as well
            margin = FAULT_AROUND_BYTES // self.shard.element_size()
            self.param_files.drop("shard", max(0, span.start - margin), span.stop + margin)

    def _host_buffer(self, dtype):
        """A staging window, page-locked for a GPU (copies at bus speed)."""
        return torch.empty(self.staging_chunk, dtype=dtype,
                           pin_memory=self.device.type == "cuda")

    def _register(self, name, tensor):
        if self.device.type == "cpu":
            self.buffers[name] = None if tensor is None else _C.Buffer(tensor)
            self._registered_at[name] = None if tensor is None else tensor.data_ptr()

    def current_buffers(self) -> dict:
        """The registered Buffers, re-made for a tensor whose memory moved
        since: share_memory_() (model.share_memory(), or sending the model
        to a torch.multiprocessing child) moves a storage's memory and frees
        the old block, and a Buffer's pointer would then write into freed
        memory."""
        for name, t in self.tensors.items():
            if t is not None and t.data_ptr() != self._registered_at[name]:
                self._register(name, t)
        return self.buffers

    # ---- stages 0-1: gradients in a full flat buffer -----------------------

    def point_grads_at_flat(self):
        if self.accumulate_by_hook:
            return
        for i, p in enumerate(self.params):
            p.grad = self.view(self.grad_flat, i)

    def accumulate_grad(self, i):
        """Post-accumulate-grad hook body for parameter i when the flat
        buffer is wider than the parameters (grad_accum_dtype): the
        gradient is added in and dropped, as at stages 2-3."""
        p = self.params[i]
        self.view(self.grad_flat, i).add_(p.grad)
        p.grad = None

    def gather_stray_grads(self):
        """A .grad replaced outside the engine (optimizer.zero_grad() sets
        None; the next backward allocates anew) is copied back in."""
        if self.accumulate_by_hook:
            for i, p in enumerate(self.params):
                if p.grad is not None:  # set by hand since the last hook
                    self.accumulate_grad(i)
            return
        item = self.grad_flat.element_size()
        base = self.grad_flat.data_ptr()
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                self.view(self.grad_flat, i).zero_()
            elif g.data_ptr() != base + self.layout_start[i] * item:
                self.view(self.grad_flat, i).copy_(g)
            p.grad = self.view(self.grad_flat, i)

    def reduce_full(self):
        """Stages 0-1, at the boundary: sum the gradients over ranks."""
        if self.stage == 0:
            self.comm.all_reduce_sum(self.grad_flat)
        else:
            unit = self.units[0]
            for r in range(self.num_partitions):
                self.comm.reduce_sum(unit.chunk(self.grad_flat, r), dst=r)

    def reduce_across_replicas(self):
        """[Note: hybrid sharding] At the boundary, once the gradients are
        reduced inside the partitions' group: this rank's partition summed
        over its replicas (the same partition on each), so every replica
        steps on the sum over every data-parallel rank. Stage 0 holds one
        partition, the whole model."""
        replicate = self.comm.replicate
        if replicate is not None and replicate.world > 1:
            replicate.all_reduce_sum(self.grad_part)

    # ---- stages 2-3: bucketed reduction from hooks ----------------------------

    def _plan_buckets(self, bucket_elements):
        self.buckets = []  # (unit, start, end) in unit coordinates; 0 = last
        for unit in reversed(self.units):
            end = unit.span
            while end > 0:
                start = max(0, end - bucket_elements)
                self.buckets.append((unit, start, end))
                end = start
        # which buckets each parameter touches
        self.param_buckets = [[] for _ in self.params]
        for b, (unit, bs, be) in enumerate(self.buckets):
            for j, i in enumerate(unit.members):
                lo = unit.offsets[j]
                if lo < be and bs < lo + unit.numels[j]:
                    self.param_buckets[i].append(b)
        self.on_unit_grads_done = None  # stage 3 releases the unit then
        # [Note: expected gradients] A bucket leaves once every parameter
        # *expected* to get a gradient has one. At first all are expected;
        # after each backward, those that got one on some rank (agreed by a
        # small all-reduce, so every rank expects the same). A parameter
        # unused on a step (a pooler under masked-LM training) then does
        # not hold back every bucket after it until the end of backward.
        self.expected = bytearray(b"\x01" * len(self.params))
        self.never_expected = ()  # see never_expect
        self.reset_buckets()
        self.in_flight = []
        self.peak_bucket_bytes = 0

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
        self.pending = [0] * len(self.buckets)
        for i, buckets in enumerate(self.param_buckets):
            if self.expected[i]:
                for b in buckets:
                    self.pending[b] += 1
        # A unit goes once all its parameters have their gradients. One with
        # a parameter that got none last time (not expected) waits for the
        # end of the backward instead: autograd may still read that
        # parameter after the others' gradients are in, and not every read
        # goes through stage 3's saved-tensor hook (activation
        # checkpointing keeps its own).
        self.unit_pending = [len(u.members) if all(self.expected[i] for i in u.members)
                             else None for u in self.units]
        self.staging = [None] * len(self.buckets)
        self.next_bucket = 0
        self.fired = bytearray(len(self.params))  # got a gradient this backward
        self.late = {}  # bucket -> gradients that came after it was launched
        self.stalled = False  # see _wait_a_while

    def _staging(self, b):
        if self.staging[b] is None:
            _unit, bs, be = self.buckets[b]
            self.staging[b] = self._bucket_buffer(be - bs)
            live = sum(s.numel() for s in self.staging if s is not None) + \
                sum(f[1].numel() for f in self.in_flight)
            self.peak_bucket_bytes = max(self.peak_bucket_bytes,
                                         live * self.compute_dtype.itemsize)
        return self.staging[b]

    def _bucket_buffer(self, n):
        # in the compute dtype, whatever the partition accumulates in:
        # what travels is what backward produced
        return torch.zeros(n, dtype=self.compute_dtype, device=self.device)

    def on_grad_ready(self, i):
        """Post-accumulate-grad hook body for parameter i (stages 2-3)."""
        p = self.params[i]
        g = p.grad.reshape(-1)
        unit = self.unit_of[i]
        lo = unit.offsets[i - unit.members.start]
        # A parameter's gradient can be accumulated more than once in one
        # backward (reentrant activation checkpointing runs a nested backward
        # per checkpointed call): later parts add into the bucket, or, once
        # the bucket has left, into a late bucket reduced at the end.
        first = not self.fired[i]
        self.fired[i] = 1
        for b in self.param_buckets[i]:
            _unit, bs, be = self.buckets[b]
            s, e = max(lo, bs), min(lo + g.numel(), be)
            if b < self.next_bucket:
                target = self.late.get(b)
                if target is None:
                    target = self.late[b] = self._bucket_buffer(be - bs)
            else:
                target = self._staging(b)
            target[s - bs:e - bs].add_(g[s - lo:e - lo])
            if first and self.expected[i]:
                self.pending[b] -= 1
                # launch as soon as a bucket fills, so a parameter spanning
                # many buckets never holds them all at once
                self._launch_ready(force=False)
        p.grad = None
        if first and self.unit_pending[unit.index] is not None:
            self.unit_pending[unit.index] -= 1
            if self.unit_pending[unit.index] == 0 and self.on_unit_grads_done is not None:
                self.on_unit_grads_done(unit)

    def _launch_ready(self, force):
        while self.next_bucket < len(self.buckets) and \
                (force or self.pending[self.next_bucket] == 0):
            self._launch(self.next_bucket)
            self.next_bucket += 1

    def _launch(self, b, late=None):
        unit, bs, be = self.buckets[b]
        staging = self._staging(b) if late is None else late
        works, mine = [], None
        r = bs // unit.part
        while r * unit.part < be:
            lo, hi = max(bs, r * unit.part), min(be, (r + 1) * unit.part)
            portion = staging[lo - bs:hi - bs]
            works.append(self.reduce_comm.reduce_sum(portion, dst=r, async_op=True))
            if r == self.comm.rank:
                mine = (portion, unit.shard_offset + lo - r * unit.part)
            r += 1
        if late is None:
            self.staging[b] = None
        self.in_flight.append((works, staging, mine))
        self._retire(wait=False)

    def _retire(self, wait):
        """Add this rank's reduced portions of the buckets in flight into its
        gradient partition, oldest first (the same order every time, so the
        same bits); their staging memory is then free. All of them when
        `wait`; else the complete ones, waiting (a while: [Note: rank-local
        gradients]) only while more than MAX_IN_FLIGHT are left."""
        while self.in_flight:
            works, _staging, mine = self.in_flight[0]
            if not wait and not _complete(works) and \
                    (len(self.in_flight) <= MAX_IN_FLIGHT or not self._wait_a_while(works)):
                return
            self.in_flight.pop(0)
            for w in works:
                if w is not None:
                    w.wait()
            if mine is not None:
                portion, off = mine
                self.grad_part[off:off + portion.numel()].add_(portion)

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
                return False
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        return True

    def finish_backward(self):
        """End of a backward: reduce what is left, in order; agree with the
        other ranks on which parameters got gradients and which buckets got
        late gradients; reduce the late buckets (zeros where this rank has
        none), in order; collect."""
        self._launch_ready(force=True)
        flags = list(self.fired) + [int(b in self.late) for b in range(len(self.buckets))]
        if self.comm.world > 1:
            # host numbers: on the CPU (gloo) where the group allows, so
            # reading them back does not wait for the GPU
            flags = torch.tensor(flags, dtype=torch.int32, device=self.comm.scalar_device)
            self.comm.all_reduce_sum(flags)
            flags = flags.tolist()
        for b in range(len(self.buckets)):
            if flags[len(self.params) + b]:
                late = self.late.get(b)
                if late is None:
                    _unit, bs, be = self.buckets[b]
                    late = self._bucket_buffer(be - bs)
                self._launch(b, late)
        self._retire(wait=True)
        counts = flags[:len(self.params)]
        world = self.comm.world
        rank_local = [i for i, n in enumerate(counts) if 0 < n < world]
        if rank_local:  # [Note: rank-local gradients]
            self.never_expected = tuple(sorted(set(self.never_expected) | set(rank_local)))
        self.expected = bytearray(1 if n else 0 for n in counts)
        for i in self.never_expected:
            self.expected[i] = 0
        self.reset_buckets()
        self.reduced_since_step = True

    def abandon_backward(self):
        """Forget a backward that raised: wait for the reductions already
        issued (a collective cannot be taken back) and drop the rest."""
        self._retire(wait=True)
        self.reset_buckets()

    @property
    def backward_started(self):
        return self.next_bucket > 0 or any(self.fired)

    # ---- after the step ------------------------------------------------------

    def all_gather_params(self):
        """Refresh the gathered units from the updated shard (stages 1-2:
        the whole group; stage 3: the persistent units)."""
        if self.num_partitions == 1 and self.stage != 3:
            return
        for unit in self.units:
            if unit.gathered:
                mine = self.shard[unit.shard_slice]
                if self.stage != 3 and mine.device.type != "cpu":
                    # it aliases unit.full, which NCCL's all-gather may not
                    # read from; gloo's broadcasts leave it in place
                    mine = mine.clone()
                self.comm.all_gather_into(unit.full, mine)
        self.drop_param_pages()  # the chunks just read ([Note: shard on a disk])

    def zero_grads(self):
        if self.grad_flat is not None:
            self.grad_flat.zero_()
        else:
            self.grad_part.zero_()

    def zero_grads_of(self, members: set):
        """Drop the gradients since the last step of the listed parameters
        (indices in the group): a submodule's zero_grad(). Stages 0-1 zero
        their places in the flat buffer (a wider grad_accum_dtype took them
        out of .grad already); stages 2-3 their reduced elements in this
        rank's partition (each rank drops its own)."""
        for unit in self.units:
            for j in range(len(unit.params)):
                if unit.members.start + j not in members:
                    continue
                if self.grad_flat is not None:
                    self.view(self.grad_flat, unit.members.start + j).zero_()
                else:
                    lo, hi, span = self.partition_span(unit, j)
                    if lo < hi:
                        self.grad_part[span].zero_()

    def partition_span(self, unit, j):
        """The elements of unit parameter j that this rank's partition
        holds: (lo, hi) in the unit's layout, and the slice of the partition
        (shard, master, grad_part) that holds them; none when lo >= hi."""
        lo = max(unit.offsets[j], self.owner * unit.part)
        hi = min(unit.offsets[j] + unit.numels[j], (self.owner + 1) * unit.part)
        start = unit.shard_offset + lo - self.owner * unit.part
        return lo, hi, slice(start, start + max(0, hi - lo))

    def gather_master(self) -> torch.Tensor:
        """The full fp32 master in the unsharded layout, on every rank, in
        host memory. On a GPU it travels in slices of GATHER_SLICE elements
        per rank: at stages 0-2 a unit is the whole group, which in fp32
        the GPU may not have room for."""
        full = torch.empty(self.layout_size, dtype=torch.float32)
        source = self.master if self.trainable else self.shard
        n = self.num_partitions
        for unit in self.units:
            out = full[unit.layout_offset:unit.layout_offset + unit.total]
            mine = source[unit.shard_slice].detach()
            if n == 1:
                out.copy_(mine)
            elif self.device.type == "cpu":
                self.comm.all_gather_into(out, mine.float().clone())
            else:
                gather_in_slices(self.comm, out, mine, n, GATHER_SLICE)
        return full

    def nbytes(self) -> dict:
        item = self.shard.element_size()
        gathered = sum(u.total for u in self.units if u.gathered and u.persistent) * item
        # an offloaded shard ([Note: shard on a disk]) is counted apart
        params_offloaded = self.shard.nbytes if self.param_files is not None else 0
        if self.stage != 3:
            params = gathered
        else:
            params = self.shard.nbytes - params_offloaded + gathered
        if not self.trainable:
            return {"params": params, "grads": 0, "optimizer_states": 0, "offloaded": 0,
                    "host": 0, "buckets": 0, "persistent": gathered if self.stage == 3 else 0,
                    "params_offloaded": params_offloaded}
        master = 0 if self.master is self.shard else self.master.nbytes
        states = master + sum(t.nbytes for t in self.states.values())
        offloaded = 0
        if self.offload is not None:
            # in RAM: the step's windows ([Note: offloaded step] in _nvme.py)
            offloaded = self.offload.nbytes
            states = self.offload.window_bytes(self.part_size)
        host = 0
        if self.staged:  # none on the model's device; in host memory with the staging windows
            host = states + sum(t.nbytes for t in self.host_windows.values())
            states = 0
        return {
            "params": params,
            "grads": (self.grad_flat if self.grad_flat is not None else self.grad_part).nbytes,
            "optimizer_states": states,
            "offloaded": offloaded,
            "host": host,
            "buckets": getattr(self, "peak_bucket_bytes", 0),
            "persistent": gathered if self.stage == 3 else 0,
            "params_offloaded": params_offloaded,
        }


def _complete(works) -> bool:
    return all(w is None or w.is_completed() for w in works)


def gather_in_slices(comm, out, mine, n, slice_elements):
    """out (host, n equal chunks) = every rank's `mine` (a chunk on the
    device), slice_elements of each chunk per all-gather, so the device
    holds n * slice_elements fp32 elements at a time."""
    part = mine.numel()
    for lo in range(0, part, slice_elements):
        hi = min(lo + slice_elements, part)
        # on the model's device (a staged master is on the host): the
        # group's collectives may be NCCL only
        gathered = torch.empty(n * (hi - lo), dtype=torch.float32, device=comm.device)
        comm.all_gather_into(gathered, mine[lo:hi].to(comm.device, torch.float32))
        # rank r's slice goes to its own chunk, at the same offset
        out.view(n, part)[:, lo:hi].copy_(gathered.view(n, hi - lo))

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
  The buckets: _buckets.py (the plan and the hooks in C: csrc/buckets.c).
"""
from __future__ import annotations

import os

import torch

import zero._C as _C
from zero.sharding._partitioned_init import take_values
from zero.offload._mapped import release_freed_memory
from zero.offload._nvme import whole_pages
from zero.offload._param_staging import host_buffer
from zero.comm._gather_together import gathers_together
from zero.sharding._buckets import BucketReducer
from zero.sharding._failed_build import give_back_released
from zero.sharding._group_grads import GroupGradients
from zero.sharding._units import Unit, lay_out

# how far around a faulting page Linux maps a file's pages in (its default
# fault_around_bytes)
FAULT_AROUND_BYTES = 64 << 10

# gather_unit's slice per rank on a GPU (16M fp32 elements: 64 MiB a rank)
GATHER_SLICE = 1 << 24
# [Note: seeding small units together] the most fp32 elements of several
# units seeded in one broadcast (1 MiB: on 2 gloo ranks about where a
# broadcast's bytes start to cost more than its latency; a rank then holds
# at most this beside one unit while building); a larger unit goes alone
SEED_TOGETHER = 1 << 18
STAGING_CHUNK = 1 << 22  # elements a staged step moves between device and host at a time
# windows per side of a staged step: one being copied while the other is
# updated ([Note: pipelined staged step] in step/_staged_copies.py)
STAGING_SLOTS = 2


class FlatGroup(GroupGradients):
    def __init__(self, index, params, names, compute_dtype, comm, policy, bucket_elements,
                 units=None, trainable=True, device=torch.device("cpu"), grad_dtype=None,
                 offload=None, staged=False, reduce_comm=None, param_files=None,
                 copier=None, delayed=None, bucket_reduction="reduce"):
        """policy: the stage's StagePolicy (_policy.py).
        units: lists of indices into params, one list per unit (stage 3);
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
        parameters (offload_param "nvme"): see [Note: shard on a disk].
        bucket_reduction: "reduce", "reduce_scatter" or "auto" (the
            config's; [Note: bucket reduction] in _buckets.py).
        copier: a _param_staging.ShardCopier when stage 3's shard lives
        in host memory or files apart from the model's device (a GPU
        model under offload_param): see [Note: parameters off the device]
        in _param_staging.py.
        delayed: the engine's step/_delayed.DelayedUpdate when the staged
        step's update runs a step late ([Note: delayed update] there)."""
        if units is None:
            units = [list(range(len(params)))]
        order = [i for members in units for i in members]
        self.index = index
        self.params = [params[i] for i in order]
        self.names = [names[i] for i in order]
        # ids of the model's parameters its forward writes (Embedding's
        # max_norm): set by the engine, named when ranks' writes differ
        self.renormed_in_forward = frozenset()
        self.comm = comm
        self.reduce_comm = reduce_comm or comm
        self.policy = policy
        self.trainable = trainable
        self.compute_dtype = compute_dtype
        self.device = device
        self.staged = staged
        self.state_device = torch.device("cpu") if staged else device
        self.offload = offload if trainable else None
        self.param_files = param_files
        self.copier = copier
        # stage 3's small units gathered several at a time: gloo, and the
        # shard read where it lies ([Note: small units gathered together])
        self.gathers_together = gathers_together(comm) and copier is None and \
            param_files is None
        self.shard_on_host = copier is not None
        # with the staged step, the gradient partition joins the shard and
        # the states on the host
        self.grads_on_host = self.shard_on_host and staged and trainable
        self.delayed = delayed if trainable else None
        self.num_partitions = comm.world if policy.partitions else 1
        self.numel = sum(p.numel() for p in self.params)  # Ψ of this group
        self.owner = comm.rank if policy.partitions else 0
        self.units: list[Unit] = lay_out(self.params, [len(m) for m in units],
                                         self.num_partitions)
        self.unit_of = []      # param index -> its unit
        self.layout_start = []  # param index -> offset in the unsharded layout
        for unit in self.units:
            for j in range(len(unit.members)):
                self.unit_of.append(unit)
                self.layout_start.append(unit.layout_offset + unit.offsets[j])
        self._owned_pieces = None  # owned_pieces(), once worked out
        self.part_size = sum(u.part for u in self.units)     # this rank's partition
        self.layout_size = sum(u.total for u in self.units)  # the unsharded layout
        try:
            self._build_buffers(compute_dtype)
        except BaseException:
            give_back_released(self)  # [Note: a failed stage-3 build gives back]
            raise
        self.states: dict[str, torch.Tensor] = {}
        # updates made (SGD: those that used the momentum buffer; see
        # counts_as_step in step/_registry.py)
        self.step_count = 0
        self.reduced_since_step = False
        self.accumulate_by_hook = False
        self.reducer = None  # stages 2-3: the buckets reduced from hooks
        if not trainable:
            return
        if not policy.partitions_grads:
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
            grad_dtype = grad_dtype or compute_dtype
            if self.grads_on_host:
                self.grad_part = host_buffer(self.part_size, grad_dtype, device).zero_()
            else:
                self.grad_part = torch.zeros(self.part_size, dtype=grad_dtype, device=device)
            self.reducer = BucketReducer(self, bucket_elements, bucket_reduction)
        self.tensors["grad"] = self.grad_part
        self._register("grad", self.grad_part)
        if self.delayed is not None:
            # whole partitions instead of a staged step's windows: the
            # update of one step runs while the next backward refills the
            # gradients and the model computes with the parameters
            self.delayed_grad = host_buffer(self.part_size, self.grad_part.dtype, device)
            self.delayed_params = host_buffer(self.part_size, compute_dtype, device)
        if self.staged:
            # page-locked windows the step stages a chunk of the gradients
            # in and of the rounded parameters out through; chunk-sized, so
            # locked memory stays small (torch also rounds a page-locked
            # block up to a power of two)
            chunk = offload.chunk if self.offload is not None else STAGING_CHUNK
            self.staging_chunk = max(1, min(chunk, self.part_size))
            # what is on the host already needs none: the step reads the
            # gradients and writes the parameters in place
            self.host_windows = {}
            if not self.grads_on_host and self.delayed is None:
                self.host_windows["grad"] = self._host_buffer(self.grad_part.dtype)
            if not self.shard_on_host and self.delayed is None:
                self.host_windows["copy_out"] = self._host_buffer(compute_dtype)

    def _build_buffers(self, compute_dtype):
        """Seed the shard (and fp32 master) from the parameters' values on
        rank 0, a unit at a time (small ones a few at a time: [Note: seeding
        small units together]), so no rank holds more than the model itself
        plus one unit, or SEED_TOGETHER elements, in fp32."""
        fp32 = compute_dtype == torch.float32
        releasing = self.policy.partitions_params
        # an offloaded master is written straight into its file, so RAM
        # never holds a second copy of this rank's partition
        own_master = has_own_master(fp32, self.staged, self.shard_on_host,
                                    self.delayed is not None)
        master_file = None
        if self.offload is not None and own_master:
            master_file = self.offload.create("master", self.part_size)
        if releasing:
            if self.param_files is not None:
                self.shard = self.param_files.create("shard", self.part_size, dtype=compute_dtype)
            elif self.shard_on_host:
                self.shard = host_buffer(self.part_size, compute_dtype, self.device)
            else:
                self.shard = torch.empty(self.part_size, dtype=compute_dtype, device=self.device)
            self.master = None
            if self.trainable:
                self.master = self.shard if not own_master else master_file \
                    if master_file is not None else \
                    torch.empty(self.part_size, dtype=torch.float32, device=self.state_device)
        for batch in seed_batches(self.units):
            every32 = torch.zeros(sum(u.total for u in batch), dtype=torch.float32,
                                  device=self.device)
            for unit, full32 in zip(batch, _views(every32, batch)):
                for j, p in enumerate(unit.params):
                    # a partitioned_init placeholder is gathered here, one
                    # parameter at a time, and its chunk freed
                    full32[unit.offsets[j]:unit.offsets[j] + unit.numels[j]].copy_(
                        take_values(p).reshape(-1))
            self.comm.everyone.broadcast(every32, src=0)  # the replicas too
            for unit, full32 in zip(batch, _views(every32, batch)):
                self._seed_unit(unit, full32, releasing, fp32, own_master, master_file,
                                compute_dtype)
            del every32, full32
            if releasing:
                release_freed_memory()  # one batch's values at a time, really
        # the update's operands as tensors (the GPU step), and on the CPU
        # also registered with the C core once, so a step passes no DLPack
        self.buffers, self.tensors, self._registered_at = {}, {}, {}
        if self.trainable:
            self.tensors["master"] = self.master
            # a device step cannot write a host shard: write_back_shard()
            # copies the new parameters over after the update
            apart = self.shard_on_host and not self.staged
            self.tensors["copy_out"] = None if self.master is self.shard or apart \
                else self.shard
            for k, t in self.tensors.items():
                self._register(k, t)

    # ---- layout helpers --------------------------------------------------

    def _seed_unit(self, unit, full32, releasing, fp32, own_master, master_file,
                   compute_dtype):
        """One unit's buffers from its values in fp32 (full32, the world's
        chunks, broadcast already): this rank's chunk into the shard and
        master at stage 3, the unit's buffer itself at stages 0-2."""
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

    def view(self, layout, i):
        """Parameter i's elements in a tensor of the unsharded layout."""
        unit = self.unit_of[i]
        j = i - unit.members.start
        off = self.layout_start[i]
        return layout[off:off + unit.numels[j]].view(unit.shapes[j])

    def owned_pieces(self) -> list:
        """(name, lo, hi, offset) for every stretch of a parameter in this
        rank's partition (its chunk of each unit): elements [lo, hi) of the
        flattened parameter sit at [offset, offset + hi - lo) of it. The
        layout never changes, so they are worked out once (the step of a
        tensor- or pipeline-parallel model reads them every time)."""
        if self._owned_pieces is not None:
            return self._owned_pieces
        pieces = []
        for unit in self.units:
            chunk_lo = self.owner * unit.part
            chunk_hi = chunk_lo + unit.part
            for j, (start, n) in enumerate(zip(unit.offsets, unit.numels)):
                lo, hi = max(start, chunk_lo), min(start + n, chunk_hi)
                if lo < hi:
                    pieces.append((self.names[unit.members.start + j], lo - start,
                                   hi - start, unit.shard_offset + lo - chunk_lo))
        self._owned_pieces = pieces
        return pieces

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

    def gather_source(self, span: slice) -> torch.Tensor:
        """This rank's chunk of the shard (elements `span`) where the
        all-gather can read it: on the model's device ([Note: parameters
        off the device] in _param_staging.py)."""
        mine = self.shard[span]
        return mine if self.copier is None else self.copier.to_device(mine)

    def settle_copies(self):
        """Before the host shard is written: the copies to the device that
        may still read it are done ([Note: parameters off the device])."""
        if self.copier is not None:
            self.copier.synchronize()

    def write_back_shard(self):
        """After a device step over a host shard: the new parameters, the
        master rounded, copied into the shard a chunk at a time (a staged
        or host step writes them there itself)."""
        if not self.shard_on_host or self.staged or not self.trainable:
            return
        self._copy_into_shard(self.master)

    def hand_grads_to_delayed(self):
        """A delayed update's gradients ([Note: delayed update] in
        step/_delayed.py): the partition itself where it is a buffer of its
        own beside the update's (swapped, and the next backward fills the
        other), else a copy."""
        if self.grad_flat is None and _same_kind(self.grad_part, self.delayed_grad):
            self.grad_part, self.delayed_grad = self.delayed_grad, self.grad_part
            self.tensors["grad"] = self.grad_part
            self._register("grad", self.grad_part)
        else:
            self.delayed_grad.copy_(self.grad_part)

    def take_delayed_params(self):
        """The parameters a delayed update wrote into the shard: at stage 3
        the two buffers swap where they can (the gathers read self.shard),
        else a copy a chunk at a time."""
        if self.policy.partitions_params and self.param_files is None and \
                _same_kind(self.shard, self.delayed_params):
            self.shard, self.delayed_params = self.delayed_params, self.shard
            if self.tensors.get("copy_out") is not None:
                self.tensors["copy_out"] = self.shard
                self._register("copy_out", self.shard)
            return
        self._copy_into_shard(self.delayed_params)

    def _copy_into_shard(self, source):
        """shard = source (cast to the compute dtype, across devices), a
        chunk at a time, each chunk's pages dropped for a shard on a disk."""
        for lo in range(0, self.part_size, STAGING_CHUNK):
            hi = min(lo + STAGING_CHUNK, self.part_size)
            self.shard[lo:hi].copy_(source[lo:hi])
            self.drop_param_pages(slice(lo, hi))

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
        """STAGING_SLOTS staging windows end to end."""
        return host_buffer(STAGING_SLOTS * self.staging_chunk, dtype, self.device)

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

    def units_to_refresh(self) -> list:
        """The units refreshed from the updated shard after an update
        (refresh_params: stages 1-2 the whole group, stage 3 the persistent
        units); none where nothing is partitioned."""
        if self.num_partitions == 1 and not self.policy.partitions_params:
            return []
        return [u for u in self.units if u.gathered]

    def refresh_unit(self, unit):
        """One unit's `full` gathered from every rank's updated chunk."""
        mine = self.gather_source(unit.shard_slice)
        if not self.policy.partitions_params and mine.device.type != "cpu":
            # it aliases unit.full, which NCCL's all-gather may not
            # read from; gloo's broadcasts leave it in place
            mine = mine.clone()
        self.comm.all_gather_into(unit.full, mine)

    def gather_unit(self, unit, source, out):
        """out (fp32, host, unit.total elements) = the unit's elements of
        `source`, a tensor laid out as the partition (master, shard, a
        state), from every rank (a collective where partitioned). On a GPU
        it travels in slices of GATHER_SLICE elements per rank: at stages
        0-2 a unit is the whole group, which in fp32 the GPU may not have
        room for."""
        mine = source[unit.shard_slice].detach()
        n = self.num_partitions
        if n == 1:
            out.copy_(mine)
        elif self.device.type == "cpu":
            self.comm.all_gather_into(out, mine.float().clone())
        else:
            gather_in_slices(self.comm, out, mine, n, GATHER_SLICE)

    def nbytes(self) -> dict:
        """This rank's bytes by kind. The first kinds are on the model's
        device; `host` is host memory apart from it (the staged step's
        states and windows, a host shard and gradient partition: [Note:
        parameters off the device]), `offloaded` and `params_offloaded`
        bytes in files."""
        item = self.shard.element_size()
        gathered = sum(u.total for u in self.units if u.gathered and u.persistent) * item
        # an offloaded shard ([Note: shard on a disk]) is counted apart
        # (the whole pages its file takes on the disk)
        params_offloaded = whole_pages(self.shard.nbytes) if self.param_files is not None else 0
        host_shard = self.shard.nbytes if self.shard_on_host and not params_offloaded else 0
        if not self.policy.partitions_params:
            params = gathered
        else:  # the shard in device memory, if not in a file nor on the host
            params = (0 if params_offloaded or host_shard else self.shard.nbytes) + gathered
        persistent = gathered if self.policy.partitions_params else 0
        if not self.trainable:
            return {"params": params, "grads": 0, "optimizer_states": 0, "offloaded": 0,
                    "host": host_shard, "buckets": 0, "persistent": persistent,
                    "params_offloaded": params_offloaded}
        master = 0 if self.master is self.shard else self.master.nbytes
        states = master + sum(t.nbytes for t in self.states.values())
        grads = (self.grad_flat if self.grad_flat is not None else self.grad_part).nbytes
        offloaded = 0
        if self.offload is not None:
            # in RAM: the step's windows ([Note: offloaded step] in _nvme.py)
            offloaded = self.offload.nbytes
            states = self.offload.window_bytes(self.part_size)
        if self.delayed is not None:  # the update's own copies, counted as its windows are
            states += self.delayed_grad.nbytes + self.delayed_params.nbytes
        host = host_shard
        if self.grads_on_host:
            host, grads = host + grads, 0
        if self.staged:  # none on the model's device; in host memory with the staging windows
            host += states + sum(t.nbytes for t in self.host_windows.values())
            states = 0
        return {
            "params": params,
            "grads": grads,
            "optimizer_states": states,
            "offloaded": offloaded,
            "host": host,
            "buckets": self.reducer.peak_bucket_bytes if self.reducer is not None else 0,
            "persistent": persistent,
            "params_offloaded": params_offloaded,
        }


def seed_batches(units):
    """[Note: seeding small units together] Building a group broadcasts
    each unit's values from rank 0: on gloo a small broadcast costs its
    latency, not its bytes, and a model of 200 small blocks paid 200 of
    them (10,000 Linear units: 7.4 s to initialize on 2 ranks). Consecutive
    units go in one broadcast up to SEED_TOGETHER elements in all; a larger
    unit goes alone, as before. Yields the batches, in order."""
    batch, size = [], 0
    for unit in units:
        if batch and size + unit.total > SEED_TOGETHER:
            yield batch
            batch, size = [], 0
        batch.append(unit)
        size += unit.total
    if batch:
        yield batch


def _views(every, batch):
    """Each unit's part of a batch's buffer, in order: the buffer itself
    for a batch of one (stages 0-2 keep it as the unit's buffer)."""
    if len(batch) == 1:
        return [every]
    views, at = [], 0
    for unit in batch:
        views.append(every[at:at + unit.total])
        at += unit.total
    return views


def has_own_master(fp32: bool, staged: bool, shard_on_host: bool, delayed: bool) -> bool:
    """Whether a group's fp32 master is a tensor apart from its parameters:
    they are the master only in fp32, on one device (not staged: states on
    the host; not shard_on_host: the shard on the host), and not written
    while the model computes (delayed: a delayed update writes the master
    on its thread). FlatGroup and estimate_memory both follow this."""
    return not fp32 or staged or shard_on_host or delayed


def _same_kind(a, b) -> bool:
    """Whether two buffers can trade places: same device, dtype and size."""
    return a.device == b.device and a.dtype == b.dtype and a.shape == b.shape


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

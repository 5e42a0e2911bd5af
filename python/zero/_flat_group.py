"""One param group's trainable parameters, laid out flat and partitioned
over the data-parallel ranks: the single sharding mechanism of every stage.

[Note: flat group layout]
- `flat` holds every parameter of the group in the compute dtype, padded to
  num_partitions * P elements; the module's parameters are views into it.
- Rank r owns elements [r*P, (r+1)*P) (stage 0: one partition, the whole
  buffer, on every rank). It keeps the fp32 master and optimizer states of
  that range only; in fp32 the master is the flat range itself.
- Gradients: stages 0-1 keep a full flat gradient buffer that backward
  accumulates into in place (.grad are views of it), reduced at the
  accumulation boundary; stage 2 keeps only the owned range (`grad_part`)
  and reduces fixed buckets of the flat range from post-accumulate-grad
  hooks while backward runs.
- Buckets are fixed ranges of the flat buffer, numbered from its end (the
  order backward produces gradients) and always reduced in that order, so
  every rank issues the same collectives in the same order even when some
  parameters get no gradient on some rank (their part of a bucket is zero).
- Stage 3 releases `flat` after use; the layout is the same.
"""
from __future__ import annotations

import torch

from zero import _C

ALIGN = 16  # partition sizes are multiples of 16 elements (64-byte rows)
# Each parameter starts at a multiple of 64 elements: GEMM libraries run
# slower on operands that start mid-cache-line.
PARAM_ALIGN = 64
# Buckets whose reduction may still be running while backward fills the
# next: two let communication overlap computation without holding more.
MAX_IN_FLIGHT = 2


class FlatGroup:
    def __init__(self, index, params, names, compute_dtype, comm, stage, bucket_elements):
        self.index = index
        self.params = params
        self.names = names
        self.comm = comm
        self.stage = stage
        self.num_partitions = 1 if stage == 0 else comm.world
        self.numel = sum(p.numel() for p in params)  # Ψ of this group
        self.offsets = []
        start = 0
        for p in params:
            start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
            self.offsets.append(start)
            start += p.numel()
        self.span = start  # laid-out elements, alignment gaps included
        per = -(-self.span // self.num_partitions)
        self.part_size = -(-per // ALIGN) * ALIGN
        self.total = self.part_size * self.num_partitions
        owner = 0 if stage == 0 else comm.rank
        self.part_start = owner * self.part_size
        self.part_end = self.part_start + self.part_size

        # fp32 values, identical on every rank (rank 0's), to seed both the
        # compute copy and the master partition.
        full32 = torch.zeros(self.total, dtype=torch.float32)
        for p, off in zip(params, self.offsets):
            full32[off:off + p.numel()].copy_(p.detach().reshape(-1))
        comm.broadcast(full32, src=0)
        self.flat = full32 if compute_dtype == torch.float32 else full32.to(compute_dtype)
        if compute_dtype == torch.float32:
            self.master = self.flat[self.part_start:self.part_end]
        else:
            self.master = full32[self.part_start:self.part_end].clone()
        del full32
        for i, p in enumerate(params):
            p.data = self.view(self.flat, i)
        self.buffers = {
            "master": _C.Buffer(self.master),
            "copy_out": None if compute_dtype == torch.float32
            else _C.Buffer(self.flat[self.part_start:self.part_end]),
        }
        self.states: dict[str, torch.Tensor] = {}

        if stage <= 1:
            self.grad_flat = torch.zeros(self.total, dtype=compute_dtype)
            self.grad_part = self.grad_flat[self.part_start:self.part_end]
            self.point_grads_at_flat()
        else:
            self.grad_flat = None
            self.grad_part = torch.zeros(self.part_size, dtype=compute_dtype)
            self._plan_buckets(bucket_elements)
        self.buffers["grad"] = _C.Buffer(self.grad_part)
        self.step_count = 0
        self.reduced_since_step = False

    # ---- layout helpers --------------------------------------------------

    def view(self, flat, i):
        p = self.params[i]
        off = self.offsets[i]
        return flat[off:off + p.numel()].view_as(p)

    def add_state(self, name, fill=0.0):
        if name not in self.states:
            t = torch.full((self.part_size,), fill, dtype=torch.float32)
            self.states[name] = t
            self.buffers[name] = _C.Buffer(t)

    # ---- stages 0-1: gradients in a full flat buffer -----------------------

    def point_grads_at_flat(self):
        for i, p in enumerate(self.params):
            p.grad = self.view(self.grad_flat, i)

    def gather_stray_grads(self):
        """A .grad replaced outside the engine (optimizer.zero_grad() sets
        None; the next backward allocates anew) is copied back in."""
        item = self.grad_flat.element_size()
        base = self.grad_flat.data_ptr()
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                self.view(self.grad_flat, i).zero_()
            elif g.data_ptr() != base + self.offsets[i] * item:
                self.view(self.grad_flat, i).copy_(g)
            p.grad = self.view(self.grad_flat, i)

    def reduce_full(self):
        """Stages 0-1, at the boundary: sum the gradients over ranks."""
        if self.stage == 0:
            self.comm.all_reduce_sum(self.grad_flat)
        else:
            for r in range(self.num_partitions):
                lo = r * self.part_size
                self.comm.reduce_sum(self.grad_flat[lo:lo + self.part_size], dst=r)

    # ---- stage 2: bucketed reduction from hooks ------------------------------

    def _plan_buckets(self, bucket_elements):
        self.buckets = []  # (start, end) in flat, bucket 0 at the end
        end = self.span
        while end > 0:
            start = max(0, end - bucket_elements)
            self.buckets.append((start, end))
            end = start
        # which buckets each parameter touches
        self.param_buckets = [[] for _ in self.params]
        self.bucket_params = [0] * len(self.buckets)
        for i, p in enumerate(self.params):
            lo, hi = self.offsets[i], self.offsets[i] + p.numel()
            for b, (bs, be) in enumerate(self.buckets):
                if lo < be and bs < hi:
                    self.param_buckets[i].append(b)
                    self.bucket_params[b] += 1
        self.reset_buckets()
        self.in_flight = []
        self.peak_bucket_bytes = 0
        self.reduced_since_step = False

    def reset_buckets(self):
        self.pending = list(self.bucket_params)
        self.staging = [None] * len(self.buckets)
        self.next_bucket = 0

    def _staging(self, b):
        if self.staging[b] is None:
            bs, be = self.buckets[b]
            self.staging[b] = torch.zeros(be - bs, dtype=self.grad_part.dtype)
            live = sum(s.numel() for s in self.staging if s is not None) + \
                sum(f[1].numel() for f in self.in_flight)
            self.peak_bucket_bytes = max(self.peak_bucket_bytes,
                                         live * self.grad_part.element_size())
        return self.staging[b]

    def on_grad_ready(self, i):
        """Post-accumulate-grad hook body for parameter i (stage 2)."""
        p = self.params[i]
        g = p.grad.reshape(-1)
        lo = self.offsets[i]
        for b in self.param_buckets[i]:
            bs, be = self.buckets[b]
            s, e = max(lo, bs), min(lo + p.numel(), be)
            self._staging(b)[s - bs:e - bs].copy_(g[s - lo:e - lo])
            self.pending[b] -= 1
            # launch as soon as a bucket fills, so a parameter spanning many
            # buckets never holds them all at once
            self._launch_ready(force=False)
        p.grad = None

    def _launch_ready(self, force):
        while self.next_bucket < len(self.buckets) and \
                (force or self.pending[self.next_bucket] == 0):
            self._launch(self.next_bucket)
            self.next_bucket += 1

    def _launch(self, b):
        bs, be = self.buckets[b]
        staging = self._staging(b)
        works, mine = [], None
        r = bs // self.part_size
        while r * self.part_size < be:
            lo, hi = max(bs, r * self.part_size), min(be, (r + 1) * self.part_size)
            portion = staging[lo - bs:hi - bs]
            works.append(self.comm.reduce_sum(portion, dst=r, async_op=True))
            if r == self.comm.rank:
                mine = (portion, lo - self.part_start)
            r += 1
        self.staging[b] = None
        self.in_flight.append((works, staging, mine))
        self._retire(keep=MAX_IN_FLIGHT)

    def _retire(self, keep):
        """Wait for all but the newest `keep` buckets in flight and add this
        rank's reduced portions into its gradient partition; their staging
        memory is then free."""
        while len(self.in_flight) > keep:
            works, _staging, mine = self.in_flight.pop(0)
            for w in works:
                if w is not None:
                    w.wait()
            if mine is not None:
                portion, off = mine
                self.grad_part[off:off + portion.numel()].add_(portion)

    def finish_backward(self):
        """End of a backward: reduce what is left, in order, and collect."""
        self._launch_ready(force=True)
        self._retire(keep=0)
        self.reset_buckets()
        self.reduced_since_step = True

    @property
    def backward_started(self):
        return self.next_bucket > 0 or any(
            n != c for n, c in zip(self.pending, self.bucket_params))

    # ---- after the step ------------------------------------------------------

    def all_gather_params(self):
        if self.num_partitions == 1:
            return
        shard = self.flat[self.part_start:self.part_end].clone()
        self.comm.all_gather_into(self.flat, shard)

    def zero_grads(self):
        if self.grad_flat is not None:
            self.grad_flat.zero_()
        else:
            self.grad_part.zero_()

    def gather_master(self) -> torch.Tensor:
        """The full fp32 master, on every rank."""
        if self.num_partitions == 1:
            return self.master.detach().clone()
        full = torch.empty(self.total, dtype=torch.float32)
        self.comm.all_gather_into(full, self.master.detach().clone())
        return full

    def nbytes(self) -> dict:
        master = 0 if self.buffers["copy_out"] is None else self.master.nbytes
        return {
            "params": self.flat.nbytes,
            "grads": (self.grad_flat if self.grad_flat is not None else self.grad_part).nbytes,
            "optimizer_states": master + sum(t.nbytes for t in self.states.values()),
            "buckets": getattr(self, "peak_bucket_bytes", 0),
        }

"""A flat group's gradients between backward and the step (a mixin of
FlatGroup, [Note: flat group layout] in _flat_group.py): stages 0-1's
full flat buffer that .grad views (stray gradients copied back in, the
reduction at the boundary), the sum across replicas under hybrid
sharding, and zeroing, whole or for some parameters."""
from __future__ import annotations


class GroupGradients:
    """Mixed into FlatGroup: uses its params, grad_flat, grad_part, units,
    view, layout_start, comm, policy and owner."""

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
        if not self.policy.partitions:
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

    def zero_grads(self):
        (self.grad_flat if self.grad_flat is not None else self.grad_part).zero_()
        if self.grad_flat is None or self.accumulate_by_hook:  # .grad is no view of grad_flat:
            for p in [p for p in self.params if p.grad is not None]:  # one set by hand is
                p.grad = None  # dropped (a backward would add to it, as in torch)

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

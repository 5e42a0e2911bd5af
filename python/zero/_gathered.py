"""zero.GatheredParameters: read (or change) parameters outside forward.

Under stage 3 a parameter outside its module's forward is an empty
placeholder. Inside this context its full value is there on every rank.
With modifier_rank=r, the values rank r leaves in the parameters when the
context ends are broadcast and written back into every rank's partition
(and its fp32 master), so the change survives the next step. Entering and
leaving are collectives: every rank must use the context with the same
parameters, in the same order. Under stages 0-2 the parameters are always
gathered, and a modification is still written back to the master copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class GatheredParameters:
    def __init__(self, params, modifier_rank=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None]
        if modifier_rank is not None and (isinstance(modifier_rank, bool) or
                                          not isinstance(modifier_rank, int)):
            raise TypeError(f"modifier_rank must be an int rank or None, got "
                            f"{modifier_rank!r}")
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units = []

    def __enter__(self):
        if not self.enabled:
            return self
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.modifier_rank is not None and not 0 <= self.modifier_rank < world:
            raise ValueError(f"modifier_rank {self.modifier_rank} is not a rank of this "
                             f"world of {world}")
        seen = set()
        for p in self.params:
            place = getattr(p, "_zero_place", None)
            if place is None or id(place[1]) in seen:
                continue  # not managed by an engine: nothing to gather
            seen.add(id(place[1]))
            self._units.append(place)
        for fg, unit, schedule in self._units:
            unit.active += 1
            if schedule is not None:
                schedule.ensure(fg, unit)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        try:
            if self.modifier_rank is not None and exc[0] is None:
                for fg, unit, _schedule in self._units:
                    self._write_back(fg, unit)
        finally:
            for _fg, unit, schedule in self._units:
                unit.active -= 1
                if schedule is not None:
                    schedule.release(unit)
            self._units = []
        return False

    def _write_back(self, fg, unit):
        if fg.num_partitions > 1:
            fg.comm.broadcast(unit.full, src=self.modifier_rank)
        mine = unit.chunk(unit.full, fg.owner)
        shard = fg.shard[unit.shard_slice]
        if shard.data_ptr() != mine.data_ptr():
            shard.copy_(mine)
        if fg.trainable and fg.master is not fg.shard:
            fg.master[unit.shard_slice].copy_(mine)

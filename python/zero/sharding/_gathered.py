"""zero.GatheredParameters: read (or change) parameters outside forward.

Under stage 3 a parameter outside its module's forward is an empty
placeholder. Inside this context its full value is there on every rank.
With modifier_rank=r, the values rank r leaves in the parameters when the
context ends are broadcast and written back into every rank's partition
(and its fp32 master), so the change survives the next step. Entering and
leaving are collectives: every rank must use the context with the same
parameters, in the same order. Under stages 0-2 the parameters are always
gathered, and a modification is still written back to the master copy.

Only the listed parameters are broadcast and written back, and of those
only the elements that changed reach the fp32 master: an element left as
it was keeps its fp32 value rather than its rounded compute-dtype copy.
"""
from __future__ import annotations

import torch

from zero.config._values import require_bool
from zero.comm._comm import world_size
from zero.sharding._gathered_placeholders import GatheredPlaceholders
from zero.sharding._param_writes import (check_parameters_in_place, take_in_parameter_writes,
                                write_into_partition)
from zero.sharding._step_agreement import agree_on_call


class GatheredParameters:
    """with zero.GatheredParameters(params, modifier_rank=None, enabled=True):
    the listed parameters whole on every rank inside the block (stage 3's
    released ones gathered). With modifier_rank=r, what rank r leaves in
    them is broadcast and written into every rank's partition on leaving.
    A collective: every rank enters with the same parameters. Writes inside
    need torch.no_grad(), as on any leaf that requires grad. See the module
    docstring for the details."""

    def __init__(self, params, modifier_rank=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None]
        if modifier_rank is not None and (isinstance(modifier_rank, bool) or
                                          not isinstance(modifier_rank, int)):
            raise TypeError(f"modifier_rank must be an int rank or None, got "
                            f"{modifier_rank!r}")
        self.modifier_rank = modifier_rank
        self.enabled = require_bool(enabled, "enabled")
        self._units = []
        self._saving = []  # saved-tensor hooks pushed for the block
        self._written_before = set()  # (id(group), parameter index) written before entry

    def __enter__(self):
        if not self.enabled:
            return self
        seen = set()
        self._listed = []  # (fg, unit, index in unit, value on entry)
        # built in zero.partitioned_init, no engine yet ([Note: placeholders gathered])
        self._placeholders = GatheredPlaceholders(
            [p for p in self.params if getattr(p, "_zero_place", None) is None])
        for p in self.params:
            place = getattr(p, "_zero_place", None)
            if place is None:
                continue  # not managed by an engine: a placeholder's, or nothing to gather
            if id(place.unit) not in seen:
                seen.add(id(place.unit))
                self._units.append(place)
            j = next(j for j, q in enumerate(place.unit.params) if q is p)
            self._listed.append((place.fg, place.unit, j))
        # in the model's order, not the caller's: a set of parameters (ordered
        # by their ids, which differ per process) gathered, agreed and wrote
        # back in another order on each rank
        self._units.sort(key=lambda place: (place.fg.index, place.unit.index))
        self._listed.sort(key=lambda item: (item[0].index, item[1].index, item[2]))
        # the engine's ranks: those of the group it partitions over (mesh=)
        world = self._units[0].fg.comm.dp_world if self._units else \
            world_size()
        if self.modifier_rank is not None and not 0 <= self.modifier_rank < world:
            raise ValueError(f"modifier_rank {self.modifier_rank} is not a rank of this "
                             f"world of {world}")
        self._take_in_writes()
        self._placeholders.enter()
        for fg, unit, schedule, _engine in self._units:
            unit.active += 1
            if schedule is not None:
                schedule.ensure(fg, unit)
        # what autograd saves inside (a loss term w.pow(2)) is gathered
        # again in a backward after the block, as inside a forward
        self._saving = [schedule.saving_outside_forward() for schedule in
                        {id(s): s for _f, _u, s, _e in self._units if s is not None}.values()]
        for saving in self._saving:
            saving.__enter__()
        if self.modifier_rank is not None:
            self._listed = [(fg, unit, j, self._values(unit, j).clone())
                            for fg, unit, j in self._listed]
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        try:
            # p.data = ... inside: the new values into the unit's buffer, so
            # the write-back (or the next step's refusal) sees them
            problem = None
            try:
                check_parameters_in_place(self._groups())
            except RuntimeError as error:
                problem = error
            if self.modifier_rank is not None:
                # the write-back is a broadcast: a rank whose block raised
                # skips it, so every rank must know (it hung the others)
                failed = exc[0] is not None or problem is not None
                others = self._others_failed(failed)
                if problem is None and (failed or others):
                    self._undo_changes()
                if others and not failed:
                    # its placeholders' agreement is a collective the failed rank makes
                    self._placeholders.leave(self.modifier_rank, True)
                    raise RuntimeError(
                        "another rank raised inside zero.GatheredParameters(..., "
                        f"modifier_rank={self.modifier_rank}) (its own error says why): the "
                        "write-back was skipped on every rank, and the changes made inside "
                        "were undone")
                if not failed:
                    for fg, unit, j, before in self._listed:
                        self._write_back(fg, unit, j, before)
            self._placeholders.leave(self.modifier_rank, exc[0] is not None or
                                     problem is not None)
            if problem is not None and exc[0] is None:
                raise problem
        finally:
            for saving in reversed(self._saving):
                saving.__exit__(None, None, None)
            self._saving = []
            for _fg, unit, schedule, _engine in self._units:
                unit.active -= 1
                if schedule is not None:
                    schedule.release(unit)
            self._units = []
        return False

    def _take_in_writes(self):
        # a value written into a listed parameter before entry is taken in
        # first, or the write-back (only what changed inside) would miss it;
        # a pending delayed update lands here too. The units and the
        # modifier are agreed with it: ranks that listed other parameters
        # paired their gathers (wrong values on one, silently), and other
        # modifier ranks waited in each other's broadcasts
        # With a modifier rank, a listed parameter written before entry on
        # some ranks only (refused by a step as writes that differ) is left
        # to the modifier's values, which replace it on every rank on
        # leaving: the refusal's advice, followed after it, was refused
        # again, and so was every collective after it
        units = [(place.fg.index, place.unit.index) for place in self._units]
        left_out = frozenset((fg.index, unit.members.start + j)
                             for fg, unit, j in self._listed) \
            if self.modifier_rank is not None else frozenset()
        passed_over = take_in_parameter_writes(self._groups(), self._call_text(
            f"entering with the units {units}, modifier_rank {self.modifier_rank}"),
            left_out=left_out)
        self._written_before = {(id(fg), unit.members.start + j) for fg, unit, j in passed_over}

    def _groups(self) -> list:
        return list({id(place.fg): place.fg for place in self._units}.values())

    def _call_text(self, doing: str) -> str:
        engine = self._units[0].engine() if self._units else None
        call = f"zero.GatheredParameters ({doing})"
        return call if engine is None else engine.call_text(call)

    def _others_failed(self, failed: bool) -> bool:
        """Whether the block raised on another rank (a collective)."""
        if not self._units or self._units[0].fg.comm.dp_world == 1:
            return False
        return agree_on_call(self._units[0].fg.comm, self._call_text("leaving"), failed) > 0

    def _undo_changes(self):
        """A block that raised on some rank: the listed parameters back to
        their values on entry, on every rank (kept at stages 0-2 on the
        modifier rank alone, they would differ from the partitions; a
        released stage-3 unit would refuse the change at its next gather)."""
        with torch.no_grad():
            for fg, unit, j, before in self._listed:
                self._values(unit, j).copy_(before)
                # a write from before entry stays a write the next
                # collective compares (marked seen, it was never taken in,
                # and a rank's write stayed on that rank alone, silently)
                if (id(fg), unit.members.start + j) not in self._written_before:
                    fg.seen_versions[unit.members.start + j] = unit.params[j]._version

    @staticmethod
    def _values(unit, j):
        return unit.full[unit.offsets[j]:unit.offsets[j] + unit.numels[j]]

    def _write_back(self, fg, unit, j, before):
        values = self._values(unit, j)
        if fg.comm.dp_world > 1:
            fg.comm.everyone.broadcast(values, src=self.modifier_rank)
        # a write from before entry: every element that differs from the
        # master is the modifier's, not only those changed inside
        written_before = (id(fg), unit.members.start + j) in self._written_before
        write_into_partition(fg, unit, j, None if written_before else before)
        # taken in now: not a change for the next step to find ([Note:
        # parameter writes] in _param_writes.py)
        fg.seen_versions[unit.members.start + j] = unit.params[j]._version

"""Stage 3's pass order: each forward and backward records the modules it
runs, and the next pass of the same kind prefetches along that record
([Note: stage 3 hooks] in _stage3.py: the collective order). Mixed into
Stage3Schedule, which holds the state these methods read."""
from __future__ import annotations

import torch

from zero.comm._gather_together import TOGETHER


class PassOrder:
    """Mixed into Stage3Schedule: recording a pass and prefetching along
    the last one recorded."""

    def _start_pass(self, phase):
        if phase == "forward":
            self.release_with = {}  # a forward without a backward leaves entries
        # the engine's serial in it: two engines' passes gathering units of
        # the same places (two models of one architecture) hashed alike, so
        # ranks that ran the two backwards in other orders mixed their
        # values unseen
        self.pass_hash = self.serial + 1
        self.phase = phase
        self.current = []
        self.pos = 0
        self.diverged = self.recorded[phase] is None

    def _end_pass(self):
        if self.recorded[self.phase] != self.current:
            self.recorded[self.phase] = self.current
            self._in_order = {}
        self.phase = None

    def _advance(self, index):
        if self.phase is None:
            return
        self.current.append(index)
        recorded = self.recorded[self.phase]
        if self.diverged:
            return
        if self.pos < len(recorded) and recorded[self.pos] == index:
            self.pos += 1
            self._prefetch(recorded)
        else:
            self.diverged = True

    def _prefetch(self, recorded):
        """Issue the gathers of the modules that come next, while the
        elements gathered ahead of use fit in max_prefetch and all live
        elements in max_live."""
        entries, starts = self._released_in_order(recorded)
        ahead = 0
        # the running module's units not yet gathered: gathered next, on
        # demand, so they count against max_live before anything ahead
        live = self.live + sum(u.total for _fg, u in entries[starts[self.pos - 1]:starts[self.pos]]
                               if not u.gathered and u.work is None)
        together, sending = [], 0  # small units to gather in one collective
        try:
            for k in range(starts[self.pos], len(entries)):
                fg, unit = entries[k]
                if unit.gathered or unit.work is not None or \
                        any(unit is u for _fg, u in together):
                    if unit.work is not None and fg.param_files is not None and \
                            unit.work.is_completed():
                        # a shard on a disk: its chunk unmapped once the
                        # gather is done, not at the unit's first use
                        self.ensure(fg, unit)
                    if unit.active == 0:
                        ahead += unit.total
                    continue
                if ahead + unit.total > self.max_prefetch or live + unit.total > self.max_live:
                    break
                live += unit.total
                self.counts["prefetched"] += 1
                ahead += unit.total
                alone = not self.together(fg, unit)
                if together and (alone or sending + unit.part > TOGETHER or
                                 together[0][1].full.dtype != unit.full.dtype):
                    self._gather_together(together)  # in order: the earlier units first
                    together, sending = [], 0
                if alone:
                    self._gather(fg, unit, async_op=True)
                    continue
                self._before_gather(fg, unit)  # counted live now, gathered with the next
                together.append((fg, unit))
                sending += unit.part
        finally:  # also when a check refused a unit: those before it were readied
            if together:
                self._gather_together(together)

    # [Note: reuse distance] DeepSpeed's stage3_max_reuse_distance: a unit
    # whose next use, along the recorded passes, comes before that many
    # elements of other units are gathered is not released at the end of
    # its forward. The case it is for is the turn from forward to
    # backward: the last units of the forward are the first the backward
    # gathers, so they are kept rather than released and gathered again
    # at once. Only a forward in the recorded order keeps (the decision
    # must be the same on every rank, and depends only on the recorded
    # orders, the unit sizes and whether grad mode is on: without it no
    # backward follows, so only the rest of the forward counts). A kept
    # unit is released as any gathered unit is: once its gradients are in,
    # at the end of the backward, or at the start of the next forward if
    # no backward came. It counts in the gathered memory all along. Our
    # default is 0: released right after use (DeepSpeed's is 1e9).
    def _reused_soon(self, unit) -> bool:
        if self.max_reuse <= 0 or self.phase != "forward" or self.diverged or \
                not unit.gathered or unit.persistent or unit.active > 0:
            return False  # nothing to keep, or not this rule's to decide
        recorded = self.recorded["forward"]
        entries, starts = self._released_in_order(recorded)
        ahead = entries[starts[self.pos]:]
        backward = self.recorded["backward"]
        if torch.is_grad_enabled() and backward is not None:
            ahead = ahead + self._released_in_order(backward)[0]
        between = 0
        for _fg, other in ahead:
            if other is unit:
                return True
            between += other.total
            if between >= self.max_reuse:
                return False
        return False

    def _release_kept(self):
        """Units a forward kept for a backward that never came (see [Note:
        reuse distance]): released as the next forward starts."""
        for fg in self.groups:
            for unit in fg.units:
                if unit.gathered and unit.work is None:
                    self.release(unit)

    def _released_in_order(self, recorded):
        """The units a recorded pass gathers and releases (persistent ones
        left out), in its order, and where each of its modules' start:
        made once per recorded order, as _prefetch runs at every module."""
        made = self._in_order.get(id(recorded))
        if made is None or made[0] is not recorded:
            entries, starts = [], []
            for index in recorded:
                starts.append(len(entries))
                entries.extend((fg, unit) for fg, unit in self.units_of[self.modules[index]]
                               if not unit.persistent)
            starts.append(len(entries))
            made = self._in_order[id(recorded)] = (recorded, entries, starts)
        return made[1], made[2]

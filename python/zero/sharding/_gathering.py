"""Stage 3's gathers and releases of units ([Note: stage 3 hooks] in
_stage3.py): a unit's storage and bookkeeping before its all-gather,
small units prefetched in one collective, waiting for a gather in flight,
and giving the storage back (to the gather pool on the CPU) on release."""
from __future__ import annotations

import torch

from zero.comm._gather_together import SMALL_UNIT, gather_together
from zero.sharding._groups_together import gather_entries_together
from zero.sharding._param_writes import check_released_untouched, write_in_forward_refusal

_HASH_MOD = (1 << 61) - 1


class UnitGathering:
    """Mixed into Stage3Schedule: its gathers and releases. Uses the
    schedule's comm, place, pool, live/peak_live counts, pass_hash, and
    _keyed_anew (SavedParameters)."""

    def _gather(self, fg, unit, async_op):
        self._before_gather(fg, unit)
        work = self.comm.all_gather_into(unit.full, fg.gather_source(unit.shard_slice),
                                         async_op=async_op)
        if work is None:
            self._gathered(fg, unit)
        else:
            unit.work = work

    def _gather_together(self, entries):
        """Prefetch the small units `entries`, each through _before_gather
        already, in one collective ([Note: small units gathered together]
        in comm/_gather_together.py)."""
        work = gather_together(self.comm, [unit.full for _fg, unit in entries],
                               [fg.gather_source(unit.shard_slice) for fg, unit in entries])
        if len(entries) > 1 and not self.comm.staged:
            # its buffers (this rank's chunks end to end, and the world's)
            # live until the first wait(): gathered memory too (in host
            # memory when staged: [Note: host-staged collectives])
            extra = (self.comm.world + 1) * sum(unit.part for _fg, unit in entries)
            self.live += extra
            self.peak_live = max(self.peak_live, self.live)

            def copied():
                self.live -= extra
            work.on_copied = copied
        for _fg, unit in entries:
            unit.work = work

    def _gather_kept(self, entries):
        """Gather the persistent units, (fg, unit) `entries` of every
        group, for good (at construction): the small ones several to a
        collective where their groups gather together, as the refresh after
        each step does ([Note: small units gathered together]); the others
        one by one."""
        small = [(fg, unit) for fg, unit in entries if self.together(fg, unit)]
        for fg, unit in small:
            self._before_gather(fg, unit)
        gather_entries_together(self.comm, small)  # all small: none left
        for fg, unit in small:
            self._gathered(fg, unit)
        for fg, unit in entries:
            if not self.together(fg, unit):
                self._gather(fg, unit, async_op=False)

    @staticmethod
    def together(fg, unit) -> bool:
        """Whether unit may be prefetched with others in one collective."""
        return fg.gathers_together and unit.total <= SMALL_UNIT

    def _before_gather(self, fg, unit):
        """A gather's bookkeeping and storage, before its collective."""
        if torch.compiler.is_exporting():
            # its collective reads data pointers, which export's fake
            # tensors lack: torch's error spoke of custom kernels
            raise RuntimeError(
                "torch.export of a zero stage-3 model whose parameters are released: the "
                "export traces with fake tensors, which a gather cannot fill. Export after "
                "engine.close() (the model whole again, a plain torch model), or from a model "
                "loaded with engine.full_state_dict()")
        # [Note: matched gathers] ranks running different modules would pair
        # one unit's all-gather with another's; when the sizes match, gloo
        # and NCCL mix them silently. Each pass hashes the units it gathers,
        # and the ranks compare hashes when the pass ends.
        self.pass_hash = (self.pass_hash * 1_000_003 + fg.index * 65_537 + unit.index + 1) \
            % _HASH_MOD
        check_released_untouched(fg, unit)
        self._keyed_anew(unit, unit.reserve(self.pool))
        if not unit.persistent:
            self.live += unit.total
            self.peak_live = max(self.peak_live, self.live)
            if self.pool is not None:
                self.pool.trim(self._pool_room(unit))

    @staticmethod
    def _gathered(fg, unit):
        unit.point_params()
        unit.gathered = True
        fg.drop_param_pages(unit.shard_slice)  # [Note: shard on a disk] in _flat_group.py

    def ensure(self, fg, unit):
        if unit.gathered:
            return
        if unit.work is None:
            self.counts["on_demand"] += 1
            self._gather(fg, unit, async_op=False)
            return
        unit.work.wait()
        unit.work = None
        self._gathered(fg, unit)

    def release(self, unit, after_forward=False):
        """after_forward: at a forward's end, which returns the refusal of a
        write made in it (write_in_forward_refusal), if any."""
        if unit.persistent or unit.active > 0:
            return None
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
            self._gathered(self.place[id(unit.params[0])][0], unit)
        refusal = None
        if unit.gathered:
            if after_forward:
                refusal = write_in_forward_refusal(self.place[id(unit.params[0])][0], unit)
            self.live -= unit.total
            pool = self.pool if self.pool is not None and \
                self.pool.fits(self._pool_room(unit), unit) else None
            self._keyed_anew(unit, unit.release(pool))
        return refusal

    def _pool_room(self, unit) -> int:
        """Bytes the gather pool may hold: gathered + pooled stays within
        the peak gathered ([Note: gather pool])."""
        return (self.peak_live - self.live) * unit.full.element_size()

    def release_all(self):
        for fg in self.groups:
            for unit in fg.units:
                self.release(unit)

    def _grads_done(self, unit):
        self.release(unit)

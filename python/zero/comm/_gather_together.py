"""Several small all-gathers as one, on gloo: stage 3's prefetch of small
units and its refresh of the persistent ones after a step (issue 22 item 2),
and the refresh of the small param groups at stages 1-2 (a group is one
unit there: sharding/_groups_together.py).

[Note: small units gathered together] On gloo a gather is one broadcast per
rank, and a small one costs its latency, not its bytes: measured on 2 CPU
ranks, 25,000 and 100,000 bf16 elements a rank took 0.5-0.7 ms each, a
million 1.4 ms. So the units one prefetch issues, and the persistent units
refreshed after a step, when each is small (SMALL_UNIT elements), go as one
gather: this rank's chunks laid end to end, one broadcast per rank of them
all into a buffer of world x that, and at the first wait() each unit's
chunks copied into its own buffer, rank by rank. The buffer lives only
while the gather is in flight, and a batch sends at most TOGETHER elements
a rank, so it holds at most (world + 1) x TOGETHER elements beside the units
(6M on 2 ranks: 12 MiB in bf16). A prefetch's batch counts in
memory_summary's gathered_peak until its first wait() (not when staged
through host memory, [Note: host-staged collectives]: the buffers are
then on the host); the refresh after a step, of persistent units, is not
counted anywhere (a transient of the step, like the backend's own
buffers). comm_summary counts the same elements as the separate gathers,
in one call. The order of the collectives depends only on the recorded
order and the units' sizes, as before, so every rank issues the same
ones. NCCL keeps one all_gather_into_tensor per unit (its
launches are cheap and it gathers in place), and so does a world of one
rank (a copy)."""
from __future__ import annotations

import torch

from zero.comm._comm import gather_by_broadcasts
from zero.comm._host_staging import host_copy

SMALL_UNIT = 1 << 20  # elements of a unit gathered with others
TOGETHER = 1 << 21    # elements a rank sends in one gather of several units


def gathers_together(comm) -> bool:
    """Whether this Comm's gathers of small units go together: gloo (CPU
    tensors, or a GPU's staged through host memory) with more than one
    rank."""
    return comm.world > 1 and (comm.device.type == "cpu" or comm.staged)


def gather_together(comm, outputs, shards):
    """All-gather each shards[k] (this rank's chunk) into outputs[k] (the
    world's chunks back to back), as one collective: returns the handle,
    whose wait() finishes every output. One output is gathered straight
    into its buffer."""
    if len(outputs) == 1:
        return comm.all_gather_into(outputs[0], shards[0], async_op=True)
    sizes = [s.numel() for s in shards]
    mine = torch.cat([s.reshape(-1) for s in shards])
    if comm.staged:  # gathered on the host, copied out to each unit's buffer
        mine = host_copy(mine)
        comm.log.record_staged(mine.numel() * mine.element_size() * (comm.world + 1))
    every = torch.empty(comm.world * mine.numel(), dtype=mine.dtype, device=mine.device)
    comm.log.record("all_gather", every)
    work = comm._issue("all_gather", gather_by_broadcasts, every, mine, comm.rank, comm.world,
                       comm.group, async_op=True, sources=comm.global_ranks)
    return _GatheredTogether(work, every.view(comm.world, -1), outputs, sizes)


def gather_small_together(comm, units, source) -> list:
    """Gather the units of at most SMALL_UNIT elements into their `full`
    buffers, several in each collective, and wait; source(unit) is this
    rank's chunk of it. Returns the others, for the caller to gather (stage
    3's persistent units after a step: [Note: small units gathered
    together])."""
    rest, batch, sending = [], [], 0
    for unit in units + [None]:
        if unit is not None and unit.total > SMALL_UNIT:
            rest.append(unit)
            continue
        if batch and (unit is None or sending + unit.part > TOGETHER):
            gather_together(comm, [u.full for u in batch], [source(u) for u in batch]).wait()
            batch, sending = [], 0
        if unit is not None:
            batch.append(unit)
            sending += unit.part
    return rest


class _GatheredTogether:
    """The handle of gather_together: the first wait() copies each unit's
    chunks out of the shared buffer; later ones return at once."""

    def __init__(self, work, every, outputs, sizes):
        self.work, self.every, self.outputs, self.sizes = work, every, outputs, sizes
        self.on_copied = None  # called once the shared buffer is gone

    def wait(self):
        if self.every is not None:
            self.work.wait()
            at = 0
            for out, n in zip(self.outputs, self.sizes):
                out.view(self.every.shape[0], n).copy_(self.every[:, at:at + n])
                at += n
            self.every = self.outputs = None  # the buffer goes now
            if self.on_copied is not None:
                self.on_copied()
        return True

    def is_completed(self) -> bool:
        return self.every is None or self.work.is_completed()

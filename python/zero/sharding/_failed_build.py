"""[Note: a failed stage-3 build gives back] A stage-3 initialize that
stops part way (Ctrl-C in a notebook, a disk filled while seeding) has
released the units seeded so far: their parameters are empty placeholders
whose values lie in the shard (and the fp32 master). Where the rank's
partition is the whole group (one process, or a shard group of one) those
values are all here, so they are put back into the parameters as tensors
of their own; the engine then gives every parameter its dtype from before
(engine/_handback.py, undo_failed_build). Across ranks a rank holds only
its chunk of each unit: those parameters stay placeholders, and the next
initialize names them as lost."""
from __future__ import annotations

from zero.sharding._units import storage_key


def give_back_released(fg) -> None:
    """Put the values of fg's released units back into their parameters,
    where this rank holds the whole group (see the note)."""
    if fg.num_partitions != 1 or not fg.policy.partitions_params:
        return
    master = getattr(fg, "master", None)
    shard = getattr(fg, "shard", None)
    # the fp32 master where there is one (exact), else the shard, whose
    # values are the compute dtype's
    source = master if master is not None else shard
    if source is None:
        return
    for unit in fg.units:
        placeholder = unit._placeholder  # set by a unit's first release only
        if placeholder is None:
            continue  # never seeded: its parameters hold their own values
        empty = storage_key(placeholder)
        for j, p in enumerate(unit.params):
            if storage_key(p) == empty:
                i = unit.members.start + j
                p.data = fg.view(source, i).to(device=fg.device, copy=True)

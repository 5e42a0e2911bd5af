"""The collectives of a step that every flat group issues, for all the
groups at once: the boundary reduction of stages 0-1, the replicas' sum of
hybrid sharding, the refresh of the parameters after an update, and which
groups' buckets wait for the end of the backward on one shared channel
(stages 2-3: ReductionChannels). A model with many small param groups
(layer-wise learning rates: two a layer) then pays for a few collectives a
step on gloo, not a few a group ([Note: small groups reduced together] in
comm/_reduce_together.py; [Note: small units gathered together] in
comm/_gather_together.py; [Note: small groups' buckets] in _buckets.py)."""
from __future__ import annotations

from zero.comm._gather_together import SMALL_UNIT, TOGETHER, gather_small_together
from zero.comm._reduce_together import reduces_together, all_reduce_together, reduce_together
from zero.sharding._units import lay_out


def reduce_boundary(groups):
    """Stages 0-1, at the accumulation boundary: each group's gradients
    summed over its ranks (FlatGroup.reduce_full), the small groups'
    together where the backend gains by it. Collectives in group order,
    the same on every rank."""
    together = _sharing_a_comm(groups)
    if len(together) < 2 or not reduces_together(together[0].comm):
        together = []
    for fg in groups:
        if fg not in together:
            fg.reduce_full()
    if not together:
        return
    comm = together[0].comm
    if not together[0].policy.partitions:
        all_reduce_together(comm, [fg.grad_flat for fg in together])
        return
    for r in range(comm.world):
        reduce_together(comm, [fg.units[0].chunk(fg.grad_flat, r) for fg in together], dst=r)


def sum_across_replicas(groups):
    """[Note: hybrid sharding] At the boundary, once reduced inside the
    partitions' group: each group's partition summed over its replicas
    (FlatGroup.reduce_across_replicas), the small ones together."""
    together = _sharing_a_comm(groups)
    replicate = together[0].comm.replicate if together else None
    if replicate is None or replicate.world == 1 or len(together) < 2 or \
            not reduces_together(replicate):
        together = []
    for fg in groups:
        if fg not in together:
            fg.reduce_across_replicas()
    if together:
        all_reduce_together(replicate, [fg.grad_part for fg in together])


def refresh_params(groups):
    """After an update: each group's gathered units refreshed from its
    updated shard (FlatGroup.units_to_refresh: stages 1-2 the whole group,
    stage 3 the persistent units), the small ones of every group gathered
    together where the group allows (gloo, the shard read where it lies)."""
    entries = [(fg, unit) for fg in groups for unit in fg.units_to_refresh()]
    shared = _sharing_a_comm([fg for fg in groups if fg.gathers_together])
    if shared:
        entries = [(fg, unit) for fg, unit in entries if fg not in shared] + \
            gather_entries_together(shared[0].comm,
                                    [(fg, unit) for fg, unit in entries if fg in shared])
    for fg, unit in entries:
        fg.refresh_unit(unit)
    for fg in groups:
        fg.drop_param_pages()  # the chunks just read ([Note: shard on a disk])


def gather_entries_together(comm, entries) -> list:
    """Gather the small units of the (fg, unit) `entries`, of any groups,
    several to a collective ([Note: small units gathered together] in
    comm/_gather_together.py), each from its group's shard; returns the
    entries left to gather one by one (units over SMALL_UNIT), in order."""
    owner = {id(unit): fg for fg, unit in entries}
    rest = gather_small_together(comm, [unit for _fg, unit in entries],
                                 lambda unit: owner[id(unit)].gather_source(unit.shard_slice))
    return [(owner[id(unit)], unit) for unit in rest]


class ReductionChannels:
    """Stages 2-3: which param groups' buckets wait for the end of the
    backward, to be reduced together ([Note: small groups' buckets] in
    _buckets.py), and the channel each group reduces on ([Note: reduction
    channels] in comm/_comm.py): one a group, and one for all the waiting
    groups (their collectives go at one point of the backward, in one
    order). Worked out before the groups are built, from their layouts, so
    that check_channel_room counts the channels before any is made.
    A group waits on gloo (as reduce_together's), reducing by reduce per
    rank, when its layout holds at most SMALL_UNIT elements, and the
    waiting groups hold at most TOGETHER and one bucket's size in all;
    two at least; in group order, the same on every rank.
    `layouts`: each group's (params, unit index lists or None)."""

    def __init__(self, comm, layouts, bucket_elements, reduction, num_partitions):
        sizes = [laid_out_elements(params, units, num_partitions) for params, units in layouts]
        eligible = reduces_together(comm) and reduction != "reduce_scatter"
        self.deferred, held = [], 0
        for size in sizes:
            waits = eligible and size <= SMALL_UNIT and \
                held + size <= min(TOGETHER, bucket_elements)
            self.deferred.append(waits)
            held += size if waits else 0
        if sum(self.deferred) < 2:
            self.deferred = [False] * len(sizes)
        self.channel, shared, made = [], None, 0
        for waits in self.deferred:
            if waits and shared is not None:
                self.channel.append(shared)
                continue
            shared = made if waits else shared
            self.channel.append(made)
            made += 1
        self.count = made

    def defer(self, groups):
        """Mark the waiting groups' reducers (groups: built in the order
        of the layouts)."""
        for fg, waits in zip(groups, self.deferred):
            if waits:
                assert not fg.reducer.scatter, "a group reduced by scatter cannot wait"
                fg.reducer.deferred = []


def laid_out_elements(params, units, num_partitions) -> int:
    """The elements of a group's layout, padding included (what its
    buckets hold at most): FlatGroup's lay_out of the same units."""
    units = units or [list(range(len(params)))]
    ordered = [params[i] for members in units for i in members]
    return sum(unit.total for unit in lay_out(ordered, [len(m) for m in units], num_partitions))


def _sharing_a_comm(groups) -> list:
    """The groups that collect over the first one's Comm (in an engine,
    all of them)."""
    return [fg for fg in groups if fg.comm is groups[0].comm] if groups else []

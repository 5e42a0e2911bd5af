"""The collectives of a step that every flat group issues, for all the
groups at once: the boundary reduction of stages 0-1 and the refresh of the
parameters after an update. A model with many param groups (layer-wise
learning rates: two a layer) then pays for a few collectives a step on
gloo, not a few a group ([Note: small groups reduced together] in
comm/_reduce_together.py; [Note: small units gathered together] in
comm/_gather_together.py)."""
from __future__ import annotations

from zero.comm._gather_together import SMALL_UNIT, TOGETHER, gather_small_together
from zero.comm._reduce_together import reduces_together, all_reduce_together, reduce_together


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
    updated shard (FlatGroup.all_gather_params: stages 1-2 the whole group,
    stage 3 the persistent units), the small ones of every group gathered
    together where the group allows (gloo, the shard read where it lies)."""
    entries = [(fg, unit) for fg in groups for unit in fg.units_to_refresh()]
    shared = _sharing_a_comm([fg for fg in groups if fg.gathers_together])
    owner = {id(unit): fg for fg, unit in entries if fg in shared}
    if owner:
        rest = gather_small_together(shared[0].comm,
                                     [unit for fg, unit in entries if id(unit) in owner],
                                     lambda u: owner[id(u)].gather_source(u.shard_slice))
        left = {id(unit) for unit in rest}
        entries = [(fg, unit) for fg, unit in entries
                   if id(unit) not in owner or id(unit) in left]
    for fg, unit in entries:
        fg.refresh_unit(unit)
    for fg in groups:
        fg.drop_param_pages()  # the chunks just read ([Note: shard on a disk])


def defer_small_groups(groups, bucket_elements):
    """Stages 2-3 with several param groups: which groups' buckets wait for
    the end of the backward, to be reduced together ([Note: small groups'
    buckets] in _buckets.py). On gloo (as reduce_together's), reducing by
    reduce per rank; groups of at most SMALL_UNIT gradient elements each,
    together at most TOGETHER and one bucket's size (they are held
    meanwhile); two at least, in group order, the same on every rank."""
    reducers = [fg.reducer for fg in _sharing_a_comm(groups) if fg.reducer is not None]
    chosen, held = [], 0
    for red in reducers:
        size = sum(end - start for _unit, start, end in red.buckets)
        if red.scatter or not reduces_together(red.fg.reduce_comm) or size > SMALL_UNIT or \
                held + size > min(TOGETHER, bucket_elements):
            continue
        chosen.append(red)
        held += size
    for red in chosen if len(chosen) > 1 else ():
        red.deferred = []
    return len(chosen) if len(chosen) > 1 else 0


def _sharing_a_comm(groups) -> list:
    """The groups that collect over the first one's Comm (in an engine,
    all of them)."""
    return [fg for fg in groups if fg.comm is groups[0].comm] if groups else []

"""Several small reductions as one, on gloo: the boundary reduction of many
small param groups (stages 0-1; layer-wise learning rates give a model two
groups a layer).

[Note: small groups reduced together] Each param group is its own flat
buffer, reduced by its own collectives: at stage 0 one all-reduce a group,
at stage 1 one reduce a group per rank. On gloo a small collective costs
its latency, not its bytes (0.5-0.7 ms on 2 CPU ranks up to 100,000
elements, [Note: small units gathered together]), so a model with 28 groups
paid 28 or 56 of them a step where two groups pay 2 or 4. Tensors of at
most SMALL_UNIT elements go together instead: laid end to end (one copy),
reduced as one tensor, and copied back (on the destination rank alone for
a reduce). A batch holds at most TOGETHER elements. Each element's sum is
the sum over the same ranks: on 2 ranks one addition, bit for bit the
separate reductions'; on 3 or more gloo adds in an order that depends on
where the element sits in the tensor, so within rounding of them (every
rank gets the same bits either way). The joined copy is a transient of
the step, counted nowhere (as a gather's batch after a step). comm_summary
counts the same elements in one call. NCCL keeps a collective a tensor
(its launches are cheap, and it reduces in place)."""
from __future__ import annotations

import torch

from zero.comm._gather_together import SMALL_UNIT, TOGETHER, gathers_together


def reduces_together(comm) -> bool:
    """Whether small reductions on this Comm go together: as gathers do
    (gloo: CPU tensors, or a GPU's staged through host memory; more than
    one rank)."""
    return gathers_together(comm)


def small_batches(tensors):
    """`tensors` in order, the small ones (at most SMALL_UNIT elements) in
    batches of one dtype and device of at most TOGETHER elements, each
    large one alone: a list of lists. The same on every rank given the same
    sizes, so the collectives match."""
    batches, batch, held = [], [], 0
    for t in tensors:
        small = t.numel() <= SMALL_UNIT
        fits = batch and small and held + t.numel() <= TOGETHER and \
            t.dtype == batch[0].dtype and t.device == batch[0].device and \
            batch[0].numel() <= SMALL_UNIT
        if not fits:
            if batch:
                batches.append(batch)
            batch, held = [], 0
        batch.append(t)
        held += t.numel()
    if batch:
        batches.append(batch)
    return batches


def all_reduce_together(comm, tensors):
    """Sum each of `tensors` over the ranks, in place: the small ones
    together ([Note: small groups reduced together])."""
    _together(tensors, comm.all_reduce_sum, copy_back=True)


def reduce_together(comm, tensors, dst: int):
    """Sum each of `tensors` over the ranks into rank `dst`'s: the small
    ones together ([Note: small groups reduced together]). The other ranks'
    tensors are left as they were (a reduce may have used them as scratch
    on some backends; none of their callers reads them after)."""
    _together(tensors, lambda t: comm.reduce_sum(t, dst=dst), copy_back=comm.rank == dst)


def _together(tensors, reduce, copy_back):
    """reduce(t) each batch of small_batches(tensors): a batch of one in
    place, a larger one laid end to end, and copied back where asked."""
    for batch in small_batches(tensors):
        if len(batch) == 1:
            reduce(batch[0])
            continue
        joined = torch.cat([t.reshape(-1) for t in batch])
        reduce(joined)
        if copy_back:
            at = 0
            for t in batch:
                t.view(-1).copy_(joined[at:at + t.numel()])
                at += t.numel()

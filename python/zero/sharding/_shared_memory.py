"""Parameters that share memory with one another: views of one tensor, or
one tensor wrapped in two Parameters. zero lays every parameter out in a
flat buffer of its own (the engine's groups, zero.optim's segments), which
would silently end the sharing: each would then train on its own gradient
alone, and the tensor they viewed would stop changing. torch.optim updates
the shared memory in place, so such parameters are refused by name.
(The same Parameter object listed twice, a tied weight, is one parameter.)"""
from __future__ import annotations

import torch


def memory_span(t: torch.Tensor):
    """(storage address, first byte, byte past the last) of the elements
    `t` can reach; None when it has none. Interleaved strided views count
    as overlapping: their spans cross, though no element is shared. An
    expanded tensor (a stride 0: partitioned_init's placeholders) holds no
    values of its own and has none either."""
    if t.numel() == 0 or t.device.type == "meta" or 0 in t.stride():
        return None
    size = t.element_size()
    start = t.storage_offset() * size
    reach = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return t.untyped_storage().data_ptr(), start, start + (reach + 1) * size


def first_shared_pair(spans):
    """spans: (label, memory_span or None) pairs. The labels of the first
    two whose spans overlap, or None."""
    ordered = sorted((span, label) for label, span in spans if span is not None)
    widest = None  # (end, label) of the span reaching furthest in this storage
    for (ptr, start, end), label in ordered:
        if widest is not None and widest[0] == ptr and start < widest[1]:
            return widest[2], label
        if widest is None or widest[0] != ptr or end > widest[1]:
            widest = (ptr, end, label)
    return None


def shared_memory_error(first: str, second: str, how_to_tie: str) -> ValueError:
    return ValueError(
        f"{first} and {second} share memory (views of one tensor, or one tensor wrapped in "
        "two Parameters). zero keeps each parameter in a flat buffer of its own, so they "
        "would stop sharing it and train apart, silently (torch.optim updates the shared "
        f"memory). {how_to_tie}, or give each its own memory (nn.Parameter(t.clone())).")

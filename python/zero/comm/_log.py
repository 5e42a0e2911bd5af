"""The bytes and elements each collective of a Comm carried: what
comm_summary() reports."""
from __future__ import annotations

from collections import defaultdict

import torch


class CommLog:
    """Elements and bytes per collective since the last reset().

    `moved_elements` counts what each collective carries in the ZeRO paper's
    accounting: a reduce, reduce-scatter, all-gather or broadcast of n
    elements moves n; an all-reduce moves 2n (a reduce-scatter plus an
    all-gather). `host_staged_bytes` counts the bytes copied between the
    device and host memory for collectives the group's backend cannot run
    on the device's tensors ([Note: host-staged collectives]): 0 on NCCL
    and on the CPU.
    """

    WEIGHT = {"all_reduce": 2}

    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = defaultdict(int)
        self.elements = defaultdict(int)
        self.bytes = defaultdict(int)
        self.staged_bytes = 0

    def record(self, op: str, tensor: torch.Tensor, elements: int | None = None):
        n = tensor.numel() if elements is None else elements
        self.calls[op] += 1
        self.elements[op] += n
        self.bytes[op] += n * tensor.element_size()

    def record_staged(self, nbytes: int):
        self.staged_bytes += nbytes

    def summary(self) -> dict:
        ops = {op: {"calls": self.calls[op], "elements": self.elements[op],
                    "bytes": self.bytes[op]} for op in self.calls}
        moved = sum(self.WEIGHT.get(op, 1) * e for op, e in self.elements.items())
        return {"ops": ops, "moved_elements": moved,
                "moved_bytes": sum(self.WEIGHT.get(op, 1) * b for op, b in self.bytes.items()),
                "host_staged_bytes": self.staged_bytes}

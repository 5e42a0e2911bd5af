"""A segment of zero.optim's flat layout: the parameters of one param group
that share a dtype, their flat buffers and the C Buffers over them
([Note: flat segments] in _flat.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import zero._C as _C


@dataclass
class Segment:
    """The parameters of one group that share a dtype, laid out flat."""

    params: list
    indices: list               # each parameter's index in its group
    offsets: list               # element offset of each parameter
    shapes: list                # each parameter's shape when laid out
    param_flat: torch.Tensor    # [numel] the parameters' own storage
    master: torch.Tensor        # [numel] fp32; param_flat itself for fp32
    grad_flat: torch.Tensor     # [numel] param dtype
    steps: torch.Tensor         # [len(params)] float32 per-parameter counts
    group_index: int = 0
    states: dict = field(default_factory=dict)   # name -> [numel] fp32
    buffers: dict = field(default_factory=dict)  # name -> _C.Buffer
    pointers: dict = field(default_factory=dict)  # name -> data_ptr its Buffer holds
    started: list = field(default_factory=list)  # per param: lazy states exist
    published: list = field(default_factory=list)  # per param: (entry, its items)
    seen_versions: list = field(default_factory=list)  # see _param_writes

    @property
    def numel(self) -> int:
        return self.param_flat.numel()

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        start = self.offsets[index]
        shape = self.shapes[index]
        return flat[start:start + shape.numel()].view(shape)

    def tensor_of(self, name: str) -> torch.Tensor:
        if name == "master":
            return self.master
        if name == "grad":
            return self.grad_flat
        if name == "copy_out":
            return self.param_flat
        return self.states[name]

    def make_buffer(self, name: str):
        tensor = self.tensor_of(name)
        self.buffers[name] = _C.Buffer(tensor.detach())
        self.pointers[name] = tensor.data_ptr()

    def is_slot(self, flat: torch.Tensor, tensor: torch.Tensor, index: int) -> bool:
        """Whether tensor is exactly the view of flat at index: the same
        address alone also matches a transposed view of it."""
        slot = self.view(flat, index)
        return (tensor.data_ptr() == slot.data_ptr() and tensor.dtype == slot.dtype
                and tensor.shape == slot.shape and tensor.stride() == slot.stride())


def where(seg: Segment, i: int) -> str:
    return f"parameter {seg.indices[i]} of param group {seg.group_index}"

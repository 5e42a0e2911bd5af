"""torch's column- and row-parallel styles for HuggingFace's Conv1D, the
layer GPT-2 is made of (y = x @ W + b, W of shape (in, out): nn.Linear's
transpose), which torch's ColwiseParallel and RowwiseParallel refuse.

[Note: Conv1D styles] Column-parallel splits the output features: W
Shard(1), b Shard(0); the forward's output stays this rank's columns
(to_local, no gather), as ColwiseParallel's does. A packed projection of k
equal parts end to end (GPT-2's c_attn: [q | k | v]) is split part by
part, so each rank holds its heads of q, of k and of v:
_StridedShard(dim, split_factor=k), torch's placement for "rank r holds
chunks r, r + tp, r + 2 tp". Measured on 2 gloo ranks (torch 2.13):
DTensor's addmm keeps that placement and computes locally, forward and
backward. Row-parallel splits the input features: W Shard(0), b
Replicate(), the partial outputs summed over tp (one all-reduce), as
RowwiseParallel's. Both reuse torch's input and output preparation; only
the partition (and, column-wise, the output's placement, which is kept)
differ. Built on first use: importing torch's DTensor costs half a
second."""
from __future__ import annotations

from functools import partial

from torch import nn

_STYLES = None


def conv1d_styles():
    """(ColwiseConv1D, RowwiseConv1D), the classes."""
    global _STYLES
    if _STYLES is None:
        _STYLES = _build()
    return _STYLES


def _build():
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    def distributed(module, mesh, placements, src_data_rank):
        for name, placement in placements.items():
            param = getattr(module, name, None)
            if param is not None:
                module.register_parameter(name, nn.Parameter(
                    distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
                    requires_grad=param.requires_grad))

    def check_conv1d(module, style):
        weight = getattr(module, "weight", None)
        if type(module).__name__ != "Conv1D" or weight is None or weight.dim() != 2:
            raise NotImplementedError(f"{style} splits HuggingFace Conv1D layers; got "
                                      f"{type(module).__name__} (use torch's ColwiseParallel "
                                      "and RowwiseParallel for nn.Linear)")

    class ColwiseConv1D(ColwiseParallel):
        """Output features split; `packed` equal projections end to end
        (3 for [q | k | v]) each split by heads."""

        def __init__(self, packed: int = 1):
            super().__init__()
            self.packed = packed

        def _apply(self, module, device_mesh):
            check_conv1d(module, "ColwiseConv1D")

            def partition(_name, mod, mesh):
                if mod is not module:
                    return
                if self.packed > 1:
                    weight, bias = (_StridedShard(1, split_factor=self.packed),
                                    _StridedShard(0, split_factor=self.packed))
                else:
                    weight, bias = Shard(1), Shard(0)
                distributed(mod, mesh, {"weight": weight, "bias": bias}, self.src_data_rank)

            return distribute_module(
                module, device_mesh, partition,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                _local_columns)

    class RowwiseConv1D(RowwiseParallel):
        """Input features split; the outputs summed over tp."""

        def _apply(self, module, device_mesh):
            check_conv1d(module, "RowwiseConv1D")
            self.desired_input_layouts = (Shard(-1),)

            def partition(_name, mod, mesh):
                if mod is module:
                    distributed(mod, mesh, {"weight": Shard(0), "bias": Replicate()},
                                self.src_data_rank)

            return distribute_module(
                module, device_mesh, partition,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    return ColwiseConv1D, RowwiseConv1D


def _local_columns(_module, outputs, _mesh):
    """This rank's output columns, as they are (a strided split is not
    gathered into Shard(-1): the next layer reads the local heads)."""
    return outputs.to_local()

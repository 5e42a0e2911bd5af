"""Tensor parallelism composed with ZeRO: a model whose parameters are
DTensors over the mesh's `tp` dimension (torch's parallelize_module with
ColwiseParallel / RowwiseParallel styles, Megatron-LM's layouts) trained by
the flat-buffer engine.

[Note: local parameters] The engine keeps every parameter as a view into
its flat buffers and releases stage 3's to an empty placeholder by
swapping what the parameter points at. A DTensor parameter is a wrapper
around a local tensor that its ops read from a Python attribute, so
swapping the wrapper's data does not reach the ops (measured: `p.data =
DTensor.from_local(view)` left the forward on the old storage). So zero
turns the model inside out once, at initialize:
- each DTensor parameter is replaced, in every module that registers it
  (ties kept), by a plain Parameter holding its local tensor, and in the
  optimizer's param groups by the same;
- each such module's class becomes a subclass of its own whose attribute
  lookup of those names returns DTensor.from_local(local parameter) with
  the original mesh, placements, global shape and stride. from_local is
  differentiable, so backward lands a plain local gradient on the plain
  parameter (Partial gradients of replicated parameters are reduced by
  from_local's backward: equal to one process's, measured to 0 ulp).
So everything ZeRO does (flat buffers, buckets, stage 3's gathers and
releases, offload, the C optimizers) sees plain tensors of the local
shape, while the parallel styles' forward sees the DTensors it made.
`restore` undoes it at close(): the model and optimizer get DTensor
parameters again, holding the trained values. FSDP2 swaps module classes
in the same way for its own hooks.

The engine's other duties under tp: the gradient norm counts a sharded
parameter's pieces on every tp rank and a replicated one once
(step/_clipping.py), and checkpoints record each parameter's placement
so they load under another tp size (checkpoint/_format.py).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Placement:
    """Where a parameter's local tensor sits in its global one: a slice of
    `shard_dim` (None: the whole tensor, replicated over tp).

    split_factor > 1 is torch's _StridedShard(dim, split_factor): the dim
    cut into split_factor x world chunks, and rank r holding chunks r,
    r + world, r + 2 world, ... end to end. A packed projection (GPT-2's
    c_attn, [q | k | v] in one weight) is split so, each rank holding its
    heads of q, of k and of v."""
    shard_dim: int | None
    global_shape: tuple
    stride: tuple
    placements: tuple   # the DTensor placements, to rebuild it
    mesh: object        # the tp DeviceMesh
    world: int          # the tp size
    split_factor: int = 1

    def _chunk(self) -> int:
        """Elements of shard_dim in one chunk of a rank's piece."""
        return self.global_shape[self.shard_dim] // (self.world * self.split_factor)

    def local_slice(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """tp rank `rank`'s piece of the whole tensor `full`."""
        if self.shard_dim is None:
            return full
        d, chunk = self.shard_dim, self._chunk()
        pieces = [full.narrow(d, (c * self.world + rank) * chunk, chunk)
                  for c in range(self.split_factor)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)

    def global_runs(self, rank: int, lo: int, hi: int) -> list:
        """Where elements [lo, hi) of tp rank `rank`'s flattened local
        tensor sit in the flattened whole tensor: (global lo, global hi,
        local lo) for each contiguous run. A Shard(0) piece is one run; a
        Shard(d) piece is one run per index of the dimensions before d
        (and per chunk, when strided)."""
        if self.shard_dim is None:
            return [(lo, hi, lo)]
        d = self.shard_dim
        after = math.prod(self.global_shape[d + 1:])
        run = self._chunk() * after                         # a run of the local tensor
        stride = self.global_shape[d] * after               # one outer index in the whole
        runs, k = [], lo // run
        while lo < hi:
            end = min(hi, (k + 1) * run)
            outer, chunk = divmod(k, self.split_factor)
            start = outer * stride + (chunk * self.world + rank) * run + lo - k * run
            runs.append((start, start + end - lo, lo))
            lo, k = end, k + 1
        return runs

    def whole(self, locals_by_rank: list) -> torch.Tensor:
        """The whole tensor from every tp rank's local piece, in rank order."""
        d, chunk = self.shard_dim, self._chunk()
        return torch.cat([piece.narrow(d, c * chunk, chunk) for c in range(self.split_factor)
                          for piece in locals_by_rank], dim=d)


def _dtensor_class():
    """DTensor, or None where no DTensor can exist yet: its module is not
    imported (importing it costs half a second, which a model without
    tensor parallelism should not pay at initialize), or torch was built
    without distributed."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(t) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def has_dtensor_parameters(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def _placement_of(name, p, tp_mesh) -> Placement:
    from torch.distributed.tensor import Replicate, Shard
    if p.device_mesh != tp_mesh:
        raise ValueError(f"parameter '{name}' is a DTensor over mesh {p.device_mesh}, not over "
                         f"the mesh's 'tp' dimension {tp_mesh}; parallelize the model with "
                         "parallelize_module(model, mesh['tp'], plan)")
    placement, = p.placements
    split_factor = int(getattr(placement, "split_factor", 1))
    if isinstance(placement, Replicate):
        dim = None
    elif type(placement) is Shard or type(placement).__name__ == "_StridedShard":
        dim = placement.dim % p.dim()
    else:
        raise NotImplementedError(f"parameter '{name}' has placement {placement}: zero trains "
                                  "tensor-parallel parameters that are Shard(dim), "
                                  "_StridedShard(dim) or Replicate() over tp")
    local = p.to_local()
    if dim is not None:
        expected = list(p.shape)
        world = tp_mesh.size()
        # an even split (the parallel styles' torch.chunk on sizes tp
        # divides); an uneven one would need a size per rank in checkpoints
        if p.shape[dim] % (world * split_factor) != 0:
            raise ValueError(f"parameter '{name}': dimension {dim} of shape {tuple(p.shape)} is "
                             f"sharded over tp={world}"
                             f"{f' in {split_factor} strided parts' if split_factor > 1 else ''}"
                             ", which does not divide it; choose sizes tp divides (heads, "
                             "hidden sizes, the vocabulary)")
        expected[dim] //= world
        if list(local.shape) != expected:
            raise ValueError(f"parameter '{name}': local shape {tuple(local.shape)} is not an "
                             f"even shard of {tuple(p.shape)} on dimension {dim}")
    return Placement(dim, tuple(p.shape), tuple(p.stride()), tuple(p.placements),
                     p.device_mesh, tp_mesh.size(), split_factor if dim is not None else 1)


_LOCAL_CLASSES: dict = {}


def _local_class(cls):
    """cls with attribute lookup that turns the local parameters named in
    the instance's _zero_tp back into DTensors ([Note: local parameters])."""
    sub = _LOCAL_CLASSES.get(cls)
    if sub is None:
        def __getattr__(self, name, _base=cls):
            spec = self.__dict__.get("_zero_tp", {}).get(name)
            if spec is None:
                return _base.__getattr__(self, name)
            from torch.distributed.tensor import DTensor
            return DTensor.from_local(self._parameters[name], spec.mesh, spec.placements,
                                      run_check=False, shape=spec.global_shape,
                                      stride=spec.stride)
        sub = type(cls.__name__, (cls,), {"__getattr__": __getattr__,
                                          "__module__": cls.__module__,
                                          "_zero_base_class": cls})
        _LOCAL_CLASSES[cls] = sub
    return sub


class TensorParallelLayout:
    """The model's tensor-parallel parameters, by name (every name a tied
    parameter has), after `localize`; and the tp group's Comm."""

    def __init__(self, comm, placements: dict, modules: list):
        self.comm = comm              # over the tp group (None: an estimate's)
        mesh = next(iter(placements.values())).mesh
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        self.placements = placements  # name -> Placement
        self._modules = modules       # the modules whose class was swapped

    def placement(self, name):
        return self.placements.get(name)

    def is_sharded(self, name) -> bool:
        """Whether each tp rank holds a different piece of `name` (plain
        parameters, and Replicate ones, are the same on every tp rank)."""
        placement = self.placements.get(name)
        return placement is not None and placement.shard_dim is not None

    def writes(self, name) -> bool:
        """Whether this rank's checkpoint files hold `name`'s pieces: a
        sharded parameter's on every tp rank, another's on tp rank 0."""
        return self.rank == 0 or self.is_sharded(name)

    def global_pieces(self, pieces) -> list:
        """(name, lo, hi, offset) pieces of local tensors turned into
        pieces of the whole tensors, as a checkpoint keeps them (loadable
        under any tp size, or none); those this rank does not write
        (`writes`) dropped."""
        out = []
        for name, lo, hi, offset in pieces:
            if not self.writes(name):
                continue
            placement = self.placements.get(name)
            runs = placement.global_runs(self.rank, lo, hi) if placement else [(lo, hi, lo)]
            out.extend((name, g_lo, g_hi, offset + local - lo) for g_lo, g_hi, local in runs)
        return out

    def whole_values(self, name, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a parameter from every tp rank's local
        piece of it (a collective over tp for a sharded one)."""
        placement = self.placements.get(name)
        if placement is None or placement.shard_dim is None:
            return local
        local = local.contiguous()
        every = torch.empty(self.world * local.numel(), dtype=local.dtype, device=local.device)
        self.comm.all_gather_into(every, local.reshape(-1))
        return placement.whole(list(every.view(self.world, *local.shape)))

    def restore(self, optimizer):
        """close(): DTensor parameters again, holding the local tensors'
        values, in the modules and the optimizer (ties kept); optimizer
        states of the local shape become DTensors of the same placement."""
        from torch.distributed.tensor import DTensor
        made = {}
        for module in self._modules:
            specs = module.__dict__.pop("_zero_tp")
            for name, spec in specs.items():
                local = module._parameters[name]
                if id(local) not in made:
                    value = DTensor.from_local(local.detach(), spec.mesh, spec.placements,
                                               run_check=False, shape=spec.global_shape,
                                               stride=spec.stride)
                    made[id(local)] = (local, nn.Parameter(value,
                                                           requires_grad=local.requires_grad),
                                       spec)
                module._parameters[name] = made[id(local)][1]
            module.__class__ = type(module)._zero_base_class
        for group in optimizer.param_groups:
            group["params"] = [made[id(p)][1] if id(p) in made else p for p in group["params"]]
        for local, param, spec in made.values():
            state = optimizer.state.pop(local, None)
            if state:
                optimizer.state[param] = {
                    k: DTensor.from_local(v, spec.mesh, spec.placements, run_check=False,
                                          shape=spec.global_shape, stride=spec.stride)
                    if torch.is_tensor(v) and v.shape == local.shape and v.dim() > 0 else v
                    for k, v in state.items()}


def vocabulary_parallel(model: nn.Module):
    """torch's loss_parallel() context when the model's logits stay split
    by vocabulary (a plan's loss_parallel=True), else one that does
    nothing: where a pipeline schedule or the HuggingFace Trainer computes
    the loss and its backward."""
    import contextlib
    if not getattr(model, "_zero_loss_parallel", False):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel()


def tensor_parallel_mesh(model: nn.Module):
    """The mesh of the model's first DTensor parameter (None: it has none)."""
    return next((p.device_mesh for p in model.parameters() if is_dtensor(p)), None)


def localize(model: nn.Module, optimizer, tp_mesh, comm=None) -> TensorParallelLayout | None:
    """Turn the model's DTensor parameters into plain local ones ([Note:
    local parameters]) and point the optimizer at them. None when the
    model has none. comm: a Comm over the tp group (None for an estimate).
    Refusals come before anything is changed."""
    found = {}  # id(DTensor parameter) -> (its placement, its local Parameter, it)
    where = []  # (module, name, id)
    names = {}
    for mname, module in model.named_modules():
        for pname, p in module._parameters.items():
            if p is None or not is_dtensor(p):
                continue
            full = f"{mname}.{pname}" if mname else pname
            if tp_mesh is None:
                raise ValueError(f"parameter '{full}' is a DTensor (a tensor-parallel model) "
                                 "but the mesh has no 'tp' dimension; pass mesh= a DeviceMesh "
                                 "with a 'tp' dimension, the one the model was parallelized "
                                 "over (init_device_mesh(..., mesh_dim_names=('dp_shard', "
                                 "'tp')))")
            if id(p) not in found:
                found[id(p)] = (_placement_of(full, p, tp_mesh), None, p)
            names.setdefault(id(p), []).append(full)
            where.append((module, pname, id(p)))
    if not found:
        return None
    for key, (placement, _, dtensor) in list(found.items()):
        local = nn.Parameter(dtensor.to_local().detach(), requires_grad=dtensor.requires_grad)
        found[key] = (placement, local, dtensor)
    swapped = []
    for module, pname, key in where:
        placement, local, _ = found[key]
        module._parameters[pname] = local
        if "_zero_tp" not in module.__dict__:
            module.__dict__["_zero_tp"] = {}
            module.__class__ = _local_class(type(module))
            swapped.append(module)
        module.__dict__["_zero_tp"][pname] = placement
    by_id = {key: local for key, (_, local, _) in found.items()}
    for group in optimizer.param_groups:
        group["params"] = [by_id.get(id(p), p) for p in group["params"]]
    for key, (_, local, dtensor) in found.items():
        state = optimizer.state.pop(dtensor, None)
        if state:
            optimizer.state[local] = {k: v.to_local() if is_dtensor(v) else v
                                      for k, v in state.items()}
    placements = {name: found[key][0] for key, ns in names.items() for name in ns}
    return TensorParallelLayout(comm, placements, swapped)

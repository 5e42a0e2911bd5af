"""zero.initialize's `mesh=`: which process group ZeRO partitions over.

None is the whole world, as before. A torch.distributed ProcessGroup, or a
1-D DeviceMesh (its group, whatever its dimension is named), is taken as
the data-parallel group: the engine's ranks, partitions, reductions,
gathers, agreements and checkpoints are that group's, so two engines can
train two models on two halves of the world at once. A
2-D DeviceMesh named ("dp_replicate", "dp_shard") is hybrid sharding:
partitions over dp_shard (the gathers stay inside it), replicas of them
across dp_replicate (the gradients summed over it once per step). Tensor
and pipeline dimensions are refused by name: not built yet
(docs/engine.md, "Mesh").
"""
from __future__ import annotations

import torch.distributed as dist

from zero.comm._comm import current_timeout


def _is_device_mesh(mesh) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(mesh, DeviceMesh)


def _group_of_ranks(ranks):
    """The default group when `ranks` are the whole world, else a group of
    them made by those ranks alone."""
    if len(ranks) == dist.get_world_size():
        return None
    return dist.new_group(sorted(ranks), use_local_synchronization=True,
                          timeout=current_timeout())


def resolve_mesh(mesh):
    """(shard, replicate, everyone): the group ZeRO partitions over, the
    group of this rank's replicas (None: no replicas), and the group of
    every data-parallel rank, which agreements and rank 0's broadcasts
    span. None stands for the default group."""
    if mesh is None:
        return None, None, None
    if _is_device_mesh(mesh):
        _check_initialized()
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mesh.ndim == 1:
            return _one_group(mesh.get_group())
        if mesh.ndim == 2 and names == ("dp_replicate", "dp_shard"):
            shard = _member(mesh["dp_shard"].get_group())
            replicate = _member(mesh["dp_replicate"].get_group())
            everyone = _group_of_ranks(mesh.mesh.flatten().tolist())
            return _default(shard), replicate, everyone
        raise NotImplementedError(
            f"mesh has {mesh.ndim} dimensions ({', '.join(names) or 'unnamed'}): zero takes a "
            "1-D mesh (or process group), or a 2-D mesh named ('dp_replicate', 'dp_shard') for "
            "hybrid sharding; tensor and pipeline dimensions (tp, pp) are not built yet")
    if isinstance(mesh, dist.ProcessGroup):
        _check_initialized()
        return _one_group(mesh)
    raise TypeError("mesh must be a torch.distributed DeviceMesh (1-D, or 2-D named "
                    "dp_replicate, dp_shard) or ProcessGroup, or None for the whole world; "
                    f"got {type(mesh).__name__}")


def _check_initialized():
    if not dist.is_initialized():
        raise RuntimeError("mesh: the default process group is not initialized; a mesh or "
                           "group is made on one (torch.distributed.init_process_group)")


def _member(group):
    if dist.get_rank(group) < 0:
        raise ValueError(f"mesh: this rank ({dist.get_rank()}) is not one of the group's "
                         f"ranks {dist.get_process_group_ranks(group)}; each rank passes "
                         "the group it belongs to")
    return group


def _default(group):
    return None if group is dist.group.WORLD else group


def _one_group(group):
    group = _default(_member(group))
    return group, None, group

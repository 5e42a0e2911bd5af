"""zero.initialize's `mesh=`: which process group ZeRO partitions over.

None is the whole world, as before. A torch.distributed ProcessGroup, or a
1-D DeviceMesh (its group, whatever its dimension is named), is taken as
the data-parallel group: the engine's ranks, partitions, reductions,
gathers, agreements and checkpoints are that group's, so two engines can
train two models on two halves of the world at once. A DeviceMesh of more
dimensions (dp_replicate x dp_shard for hybrid sharding, tp, pp) is
refused by name: it is not built yet (docs/engine.md, "Mesh").
"""
from __future__ import annotations

import torch.distributed as dist


def _is_device_mesh(mesh) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(mesh, DeviceMesh)


def resolve_mesh(mesh):
    """The process group `mesh` stands for (None: the default group)."""
    if mesh is None:
        return None
    if _is_device_mesh(mesh):
        if mesh.ndim != 1:
            names = getattr(mesh, "mesh_dim_names", None) or ()
            raise NotImplementedError(
                f"mesh has {mesh.ndim} dimensions ({', '.join(names) or 'unnamed'}): zero "
                "partitions over a 1-D mesh or process group for now; hybrid sharding "
                "(dp_replicate x dp_shard) and tensor or pipeline dimensions are not built "
                "yet. Pass the data-parallel dimension alone, mesh['dp_shard']")
        group = mesh.get_group()
    elif isinstance(mesh, dist.ProcessGroup):
        group = mesh
    else:
        raise TypeError("mesh must be a torch.distributed DeviceMesh (1-D) or ProcessGroup, "
                        f"or None for the whole world; got {type(mesh).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("mesh: the default process group is not initialized; a mesh or "
                           "group is made on one (torch.distributed.init_process_group)")
    if dist.get_rank(group) < 0:
        raise ValueError(f"mesh: this rank ({dist.get_rank()}) is not one of the group's "
                         f"ranks {dist.get_process_group_ranks(group)}; each rank passes "
                         "the group it belongs to")
    return None if group is dist.group.WORLD else group

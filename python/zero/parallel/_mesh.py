"""zero.initialize's `mesh=`: which process groups ZeRO's collectives use.

None is the whole world, as before. A torch.distributed ProcessGroup, or a
1-D DeviceMesh (its group, whatever its dimension is named), is taken as
the data-parallel group: the engine's ranks, partitions, reductions,
gathers, agreements and checkpoints are that group's, so two engines can
train two models on two halves of the world at once. A mesh of named
dimensions (torchtitan's names) is read by name:
- `dp_shard`: ZeRO partitions over it (the gathers stay inside it);
- `dp_replicate`: replicas of the partitions, the gradients summed over it
  once per step (hybrid sharding);
- `tp`: tensor parallelism; the model's DTensor parameters are over it and
  ZeRO partitions each rank's local pieces over the data-parallel
  dimensions only (_tensor_parallel.py);
- `pp`: pipeline parallelism; the engine trains this rank's stage of the
  model, and the norm, tied weights and checkpoints span the stages
  (_pipeline.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from zero.comm._comm import current_timeout


def _is_device_mesh(mesh) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(mesh, DeviceMesh)


# groups made by group_of_ranks, by their ranks, for the default group they
# were made in: torch names a group made by its ranks alone after them, and
# a second group of the same ranks would meet the first's keys in the store
# (measured: a hang at the next engine on the same ranks)
_made = {"world": None, "groups": {}}


def group_of_ranks(ranks):
    """The default group when `ranks` are the whole world, else a group of
    them made by those ranks alone (once per process: a later engine on the
    same ranks shares it)."""
    if len(ranks) == dist.get_world_size():
        return None
    if _made["world"] is not dist.group.WORLD:
        _made.update(world=dist.group.WORLD, groups={})
    key = tuple(sorted(ranks))
    if key not in _made["groups"]:
        _made["groups"][key] = dist.new_group(list(key), use_local_synchronization=True,
                                              timeout=current_timeout())
    return _made["groups"][key]


DATA_PARALLEL = ("dp_replicate", "dp_shard")
MODEL_PARALLEL = ("tp", "pp")
KNOWN = DATA_PARALLEL + MODEL_PARALLEL


def is_data_parallel_line(mesh) -> bool:
    """A 1-D DeviceMesh that zero partitions over whatever its name (a 1-D
    mesh named tp or pp holds model-parallel ranks only: no data-parallel
    dimension, its partitions span one rank)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return mesh.ndim == 1 and names not in (("tp",), ("pp",))


@dataclass
class MeshGroups:
    """The groups a mesh names. shard: ZeRO partitions over it; replicate:
    this rank's replicas (None: none); everyone: every data-parallel rank,
    which agreements and rank 0's broadcasts span; tp_mesh: the 1-D
    DeviceMesh of tensor parallelism (None: none); pp_mesh: that of
    pipeline parallelism; whole: every rank of the mesh (data, tensor and
    pipeline parallel), which a checkpoint's agreements span. None for a
    group stands for the default group."""
    shard: object = None
    replicate: object = None
    everyone: object = None
    tp_mesh: object = None
    pp_mesh: object = None
    whole: object = None

    @property
    def partial(self) -> bool:
        """Whether ZeRO's group is less than the whole world."""
        return self.shard is not None or self.replicate is not None or \
            self.tp_mesh is not None or self.pp_mesh is not None


def resolve_mesh(mesh) -> MeshGroups:
    """The MeshGroups `mesh` (None, a ProcessGroup or a DeviceMesh) names."""
    if mesh is None:
        return MeshGroups()
    if mesh is dist.GroupMember.NON_GROUP_MEMBER:
        # what new_group(ranks) returns on a rank outside `ranks`
        raise ValueError(f"mesh: this rank ({dist.get_rank()}) is not one of the group's ranks "
                         "(torch.distributed.new_group gave it GroupMember.NON_GROUP_MEMBER); "
                         "each rank passes the group it belongs to")
    if _is_device_mesh(mesh):
        _check_initialized()
        if mesh.get_coordinate() is None:
            raise ValueError(f"mesh: this rank ({dist.get_rank()}) is not in the DeviceMesh "
                             f"{mesh.mesh.tolist()}; each rank passes a mesh it is part of")
        if is_data_parallel_line(mesh):
            return MeshGroups(*_one_group(mesh.get_group()))
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        unknown = [n for n in names if n not in KNOWN]
        if not names or unknown or len(set(names)) != len(names):
            raise NotImplementedError(
                f"mesh has {mesh.ndim} dimensions ({', '.join(names) or 'unnamed'}): zero takes "
                "a 1-D mesh (or process group), or a mesh whose dimensions are named "
                "dp_replicate, dp_shard, tp and pp (torchtitan's names); name each dimension "
                "one of them")
        return _named(mesh, names)
    if isinstance(mesh, dist.ProcessGroup):
        _check_initialized()
        return MeshGroups(*_one_group(mesh))
    raise TypeError("mesh must be a torch.distributed DeviceMesh (1-D, or with dimensions "
                    "named dp_replicate, dp_shard, tp, pp) or ProcessGroup, or None for the whole "
                    f"world; got {type(mesh).__name__}")


def _named(mesh, names) -> MeshGroups:
    groups = _data_parallel(mesh, names)
    if "tp" in names:
        groups.tp_mesh = mesh["tp"]
    if "pp" in names:
        groups.pp_mesh = mesh["pp"]
    if "tp" in names or "pp" in names:
        groups.whole = group_of_ranks(mesh.mesh.flatten().tolist())
    return groups


def _data_parallel(mesh, names) -> MeshGroups:
    dp = tuple(n for n in DATA_PARALLEL if n in names)
    if "dp_replicate" in dp and "dp_shard" not in dp:
        raise ValueError("mesh has a dp_replicate dimension without dp_shard: replicas of "
                         "what? Name the partitioning dimension dp_shard (or drop "
                         "dp_replicate: one data-parallel dimension is dp_shard)")
    if not dp:  # model parallelism alone: each rank its own data-parallel group
        own = group_of_ranks([dist.get_rank()])
        return MeshGroups(own, None, own)
    shard = _member(mesh["dp_shard"].get_group())
    if dp == ("dp_shard",):
        everyone = _default(shard)
        return MeshGroups(everyone, None, everyone)
    replicate = _member(mesh["dp_replicate"].get_group())
    # every data-parallel rank, replicas major, whichever order the mesh
    # names the two in (torch slices a mesh in its own order only)
    both = tuple(n for n in names if n in DATA_PARALLEL)
    ranks = mesh[both].mesh
    if both != ("dp_replicate", "dp_shard"):
        ranks = ranks.t()
    ranks = ranks.flatten().tolist()
    return MeshGroups(_default(shard), replicate, group_of_ranks(ranks))


def describe_mesh(mesh) -> str:
    """The layout `mesh` gives, the same text on every rank that passed the
    same mesh (its whole rank grid and dimension names; a group's ranks;
    None: the world): initialize compares it over the ranks first."""
    if mesh is None:
        return f"the whole world ({dist.get_world_size()} ranks; mesh=None)"
    if _is_device_mesh(mesh):
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        return f"a DeviceMesh {mesh.mesh.tolist()} named {names}"
    return f"a process group of ranks {dist.get_process_group_ranks(mesh)}"


def data_parallel_place(mesh) -> tuple:
    """(this rank's index among the data-parallel ranks, their number) on
    `mesh` (None: the world, a group, or a mesh of named dimensions): the
    shard of the data this rank reads. Ranks that differ only in tp or pp
    read the same batches."""
    if not dist.is_initialized():
        return 0, 1
    if mesh is None:
        return dist.get_rank(), dist.get_world_size()
    if isinstance(mesh, dist.ProcessGroup):
        return dist.get_rank(mesh), dist.get_world_size(mesh)
    if is_data_parallel_line(mesh):
        return mesh.get_local_rank(), mesh.size()
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    sizes = dict(zip(names, mesh.mesh.shape))
    at = {name: mesh[name].get_local_rank() for name in DATA_PARALLEL if name in names}
    size = 1
    for name in at:
        size *= sizes[name]
    return _data_parallel_index(at, sizes), size


def _data_parallel_index(at: dict, sizes: dict) -> int:
    """The data-parallel index of the mesh coordinates `at` (dimension name
    -> index; sizes: dimension name -> size): replicas major, shards minor."""
    return at.get("dp_replicate", 0) * sizes.get("dp_shard", 1) + at.get("dp_shard", 0)


def data_parallel_representatives(mesh) -> list:
    """The global ranks that stand for each data-parallel place of `mesh`
    (tp and pp index 0), in data-parallel order (data_parallel_place's)."""
    import itertools
    if mesh is None:
        return list(range(dist.get_world_size()))
    if isinstance(mesh, dist.ProcessGroup):
        return dist.get_process_group_ranks(mesh)
    if is_data_parallel_line(mesh):
        return mesh.mesh.tolist()
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    sizes = dict(zip(names, mesh.mesh.shape))
    reps = {}
    for where in itertools.product(*(range(n) for n in mesh.mesh.shape)):
        at = dict(zip(names, where))
        if all(at.get(name, 0) == 0 for name in MODEL_PARALLEL):
            reps[_data_parallel_index(at, sizes)] = int(mesh.mesh[where])
    return [reps[i] for i in sorted(reps)]


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

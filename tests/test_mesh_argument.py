"""zero.initialize(mesh=...) in one process: what it accepts (a group, a
1-D mesh, meshes named dp_replicate, dp_shard, tp, pp), and what it refuses
by name (other names, a name twice; another type; a
model zero.partitioned_init partitioned over the whole world).
Training over a part of the world: tests/distributed/test_mesh_groups.py."""
import pytest
import torch
import torch.distributed as dist

import zero
from engine_cases import user_group_of_one


@pytest.fixture(autouse=True)
def one_process_group(monkeypatch):
    with user_group_of_one(monkeypatch):
        yield


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def test_a_group_and_a_1d_mesh_are_taken():
    from torch.distributed.device_mesh import DeviceMesh
    for mesh in (dist.group.WORLD, dist.new_group([0]), DeviceMesh("cpu", [0])):
        engine = zero.initialize(_model(), stage=2, mesh=mesh)
        engine.backward(engine(torch.randn(3, 4)).square().mean())
        engine.step()
        assert engine._comm.world == 1 and engine._comm.global_ranks == [0]
        engine.close()


def test_a_hybrid_mesh_is_taken():
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", [[0]], mesh_dim_names=("dp_replicate", "dp_shard"))
    engine = zero.initialize(_model(), stage=3, mesh=mesh)
    engine.backward(engine(torch.randn(3, 4)).square().mean())
    engine.step()
    assert engine._comm.replicate is not None and engine._comm.dp_world == 1
    engine.close()


@pytest.mark.parametrize("names", [("dp_shard", "tp"), ("dp_shard", "dp_replicate"),
                                   ("dp_replicate", "dp_shard", "tp"), ("tp",), ("pp",),
                                   ("pp", "dp_shard", "tp")])
def test_named_meshes_are_taken(names):
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", torch.zeros([1] * len(names), dtype=torch.int64),
                      mesh_dim_names=names)
    engine = zero.initialize(_model(), stage=2, mesh=mesh)
    engine.backward(engine(torch.randn(3, 4)).square().mean())
    engine.step()
    assert engine._comm.world == 1
    engine.close()


@pytest.mark.parametrize("shape, names, why", [
    ([[[0]]], ("pp", "dp_shard", "dp_shard"), "name each dimension one of them"),
    ([[0]], ("dp", "tp"), "named dp_replicate, dp_shard, tp and pp"),
    ([[0]], None, "name each dimension")])
def test_other_meshes_are_refused_by_name(shape, names, why):
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", shape, mesh_dim_names=names)
    shown = ", ".join(names) if names else "unnamed"
    with pytest.raises(NotImplementedError, match=rf"mesh has {mesh.ndim} dimensions \({shown}\).*{why}"):
        zero.initialize(_model(), stage=2, mesh=mesh)


def test_replicas_without_a_shard_dimension_are_refused():
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", [[0]], mesh_dim_names=("dp_replicate", "tp"))
    with pytest.raises(ValueError, match="dp_replicate dimension without dp_shard"):
        zero.initialize(_model(), stage=2, mesh=mesh)


@pytest.mark.parametrize("mesh", [0, "dp", [0]])
def test_a_mesh_of_another_type_is_refused(mesh):
    with pytest.raises(TypeError, match="mesh must be a torch.distributed DeviceMesh"):
        zero.initialize(_model(), stage=2, mesh=mesh)


def test_a_partitioned_init_model_is_refused_on_a_group():
    with zero.partitioned_init():
        model = _model()
    with pytest.raises(ValueError, match="parameter '0.weight' was built under "
                                         "zero.partitioned_init"):
        zero.initialize(model, stage=3, mesh=dist.new_group([0]))

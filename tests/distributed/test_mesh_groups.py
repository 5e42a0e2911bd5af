"""zero.initialize(mesh=...): ZeRO over a part of the world, and hybrid
sharding over a 2 x 2 mesh. On 4 gloo
ranks, ranks {0, 1} and {2, 3} train two different models at once, each
half its own engine over its own group (a ProcessGroup, or the 1-D
DeviceMesh of a 2 x 2 mesh's "dp_shard" dimension), at stages 0-3, and
each is compared with a single-process torch reference of its model
(tests/distributed/scenarios.py: tied, frozen, reused and unused
parameters, sizes 2 does not divide, two param groups). Tolerance as in
test_engine_parity.py: 1e-5 normwise relative error in fp32 (gradients
summed in another order than one process sums them, a few ulps a step).
Each half also saves a checkpoint into a directory of its own, which
consolidates to what its engine holds. Then all 4 ranks train one model
on the mesh (dp_replicate x dp_shard) at stages 0-3, against the same
single-process reference."""
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

import harness
import scenarios
from conftest import max_rel_error
from test_estimate import check as check_estimate

STEPS = 6
STAGES = [0, 1, 2, 3]
SEEDS = (0, 5)  # the model of ranks {0, 1}, of ranks {2, 3}


def train_on_group(group, seed, stage, steps, opt="adamw", lr=1e-2, save_dir=None,
                   hybrid=False, **options):
    """scenarios.engine_run on a group: its ranks shard each batch, its
    loss is averaged over it. hybrid: `group` is a 2 x 2 mesh, and the
    batch is split over all 4 ranks."""
    import torch.distributed as dist
    import zero
    if hybrid:
        pg = None
    else:  # a group, or a 1-D DeviceMesh's
        pg = group.get_group() if hasattr(group, "get_group") else group
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    model = scenarios.make_model(seed)
    engine = zero.initialize(model, optimizer=scenarios.make_optimizer(opt, model, lr),
                             stage=stage, mesh=group, **options)
    # partitions over 2 ranks: a half, or a row of the 2 x 2 mesh
    assert engine._comm.world == 2 and engine._comm.rank == dist.get_rank() % 2
    assert engine._comm.dp_world == (4 if hybrid else 2)
    losses = []
    for step in range(steps):
        ids, labels = scenarios.batch(step)
        ids, labels = scenarios.shard(ids, rank, world), scenarios.shard(labels, rank, world)
        loss = F.cross_entropy(engine(ids, use_branch=step % 2 == 0).float(), labels)
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()])
        dist.all_reduce(t, group=pg)
        losses.append(t.item() / world)
    consolidated = None
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="t")
        from zero.checkpoint import consolidate
        consolidated = consolidate(save_dir)["model"]
    state = engine.full_state_dict()
    comm = engine.comm_summary()
    if hybrid:  # what a rank holds, beside the estimate for the mesh
        fresh = scenarios.make_model(seed)
        comm["memory"] = (dict(engine.memory_summary()), dict(zero.estimate_memory(
            fresh, mesh=group, stage=stage,
            optimizer=scenarios.make_optimizer(opt, fresh, lr))))
    engine.close()
    return losses, state, consolidated, comm


def loaded_state(directory, stage, mesh=None):
    """What an engine of `stage` on `mesh` holds right after loading the
    checkpoint in `directory` (tag "t")."""
    import zero
    model = scenarios.make_model(seed=9)  # other values, overwritten by the load
    engine = zero.initialize(model, optimizer=scenarios.make_optimizer("adamw", model, 1e-2),
                             stage=stage, mesh=mesh)
    engine.load_checkpoint(directory, tag="t")
    state = engine.full_state_dict()
    engine.close()
    return state


def _halves(rank, world, keep_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    dist.init_process_group("gloo")
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    mine, seed = halves[rank // 2], SEEDS[rank // 2]
    out = {}
    for stage in STAGES:
        out[("plain", stage)] = train_on_group(mine, seed, stage, STEPS)
    out[("sgd", 3)] = train_on_group(mine, seed, 3, STEPS, opt="sgd", lr=0.1,
                                     reduce_bucket_size=50)
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp_replicate", "dp_shard"))
    with tempfile.TemporaryDirectory() as scratch:
        # one directory per half, the same on both of its ranks
        save_dir = os.path.join(scratch, f"half{rank // 2}")
        holder = [save_dir]
        dist.broadcast_object_list(holder, src=2 * (rank // 2), group=mine)
        out[("device mesh", 2)] = train_on_group(mesh["dp_shard"], seed, 2, STEPS,
                                                 save_dir=holder[0])
        dist.barrier()  # both halves done with the directory
    # hybrid sharding: partitions over the rows {0, 1}, {2, 3}, replicas
    # across the columns {0, 2}, {1, 3}; one model on all 4 ranks
    for stage in STAGES:
        out[("hybrid", stage)] = train_on_group(
            mesh, SEEDS[0], stage, STEPS, hybrid=True,
            save_dir=os.path.join(keep_dir, f"stage{stage}"))
    out["hybrid files"] = sorted(os.listdir(os.path.join(keep_dir, "stage3", "t")))
    # the same layout with its dimensions named the other way round
    reversed_names = DeviceMesh("cpu", [[0, 2], [1, 3]],
                                mesh_dim_names=("dp_shard", "dp_replicate"))
    out[("hybrid reversed", 3)] = train_on_group(reversed_names, SEEDS[0], 3, STEPS,
                                                 hybrid=True)
    # a group or mesh without this rank, passed on ranks 2 and 3 only
    lone = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp_shard",))  # made on every rank
    if rank >= 2:
        import zero
        out["not a member"] = []
        for outside in (halves[0], lone):  # new_group's NON_GROUP_MEMBER here
            try:
                zero.initialize(torch.nn.Linear(2, 2), stage=1, mesh=outside)
            except ValueError as error:
                out["not a member"].append(str(error))
    # the 2 x 2 stage-3 checkpoint loaded on other layouts: 4 ranks without
    # a mesh, 4 x 1 and 1 x 4 meshes, and each half of the world (2 ranks)
    saved = os.path.join(keep_dir, "stage3")
    out["loaded"] = {
        "4 ranks, stage 1": loaded_state(saved, 1),
        "4 x 1, stage 2": loaded_state(saved, 2, DeviceMesh(
            "cpu", [[0], [1], [2], [3]], mesh_dim_names=("dp_replicate", "dp_shard"))),
        "1 x 4, stage 3": loaded_state(saved, 3, DeviceMesh(
            "cpu", [[0, 1, 2, 3]], mesh_dim_names=("dp_replicate", "dp_shard"))),
        "2 ranks, stage 0": loaded_state(saved, 0, mine),
    }
    # a hand-built mesh whose columns pair different places of the rows
    crossed = DeviceMesh("cpu", [[0, 3], [2, 1]], mesh_dim_names=("dp_replicate", "dp_shard"))
    try:
        train_on_group(crossed, SEEDS[0], 2, 1, hybrid=True)
        out["crossed"] = None
    except ValueError as error:
        out["crossed"] = str(error)
    # ranks that pass other meshes: another shape on ranks 2 and 3, None
    # on rank 3 (each waited in initialize for the group's timeout)
    row = DeviceMesh("cpu", [[0, 1, 2, 3]], mesh_dim_names=("dp_replicate", "dp_shard"))
    out["other meshes"] = []
    for other in (mesh if rank < 2 else row, mesh if rank < 3 else None):
        try:
            train_on_group(other, SEEDS[0], 2, 1, hybrid=True)
            out["other meshes"].append(None)
        except ValueError as error:
            out["other meshes"].append(str(error))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """Where the ranks leave their hybrid checkpoints for the test to load."""
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def runs(kept):
    return harness.run(4, _halves, str(kept), timeout=600)


def reference(case, seed):
    if case == "sgd":
        return scenarios.reference_run(STEPS, seed=seed, opt="sgd", lr=0.1)
    return scenarios.reference_run(STEPS, seed=seed)


@pytest.mark.parametrize("case, stage", [("plain", s) for s in STAGES] +
                         [("sgd", 3), ("device mesh", 2)])
def test_two_halves_train_two_models_at_once(runs, case, stage):
    for half, seed in enumerate(SEEDS):
        ref_losses, ref_state = reference(case, seed)
        for rank in (2 * half, 2 * half + 1):
            losses, state, consolidated, _comm = runs[rank][(case, stage)]
            assert max_rel_error(torch.tensor(losses), torch.tensor(ref_losses)) <= 1e-5
            for name, ref in ref_state.items():
                err = max_rel_error(state[name], ref)
                assert err <= 1e-5, f"half {half} rank {rank}: {name} off by {err:.2e}"
            if consolidated is not None:
                assert all(torch.equal(consolidated[k], state[k].float())
                           for k in consolidated)
    # the two models are really different ones
    a, b = runs[0][(case, stage)][1], runs[2][(case, stage)][1]
    assert not torch.equal(a["block.weight"], b["block.weight"])


@pytest.mark.parametrize("stage", STAGES)
def test_hybrid_sharding_matches_one_process(runs, stage):
    """A 2 x 2 mesh (dp_replicate x dp_shard): 4 ranks train one model, each
    on a quarter of the batch; the same result as one process on all of it,
    on every rank, and the checkpoint (written by the first replica's ranks)
    consolidates to it."""
    ref_losses, ref_state = scenarios.reference_run(STEPS, seed=SEEDS[0])
    for rank in range(4):
        losses, state, consolidated, comm = runs[rank][("hybrid", stage)]
        # the replicas sum this rank's partition of the gradients, the two
        # small param groups' in one all-reduce a step ([Note: small groups
        # reduced together]): the whole model at stage 0, half of it after
        # (loose bounds: the state dict counts the tied weight twice and
        # holds the frozen layer; partitions are padded)
        replicated = comm["dp_replicate"]["ops"]["all_reduce"]
        assert replicated["calls"] == 1
        partition = sum(p.numel() for p in ref_state.values()) / (1 if stage == 0 else 2)
        assert partition * 0.5 < replicated["elements"] < partition * 1.5
        assert max_rel_error(torch.tensor(losses), torch.tensor(ref_losses)) <= 1e-5
        for name, ref in ref_state.items():
            err = max_rel_error(state[name], ref)
            assert err <= 1e-5, f"rank {rank}: {name} off by {err:.2e}"
        assert all(torch.equal(consolidated[k], state[k].float()) for k in consolidated)
        # memory_summary counts N = dp_shard's 2 ranks, as estimate_memory
        # does (test_estimate.py's check: what only the run knows aside)
        measured, estimated = comm["memory"]
        assert measured["world_size"] == 2
        check_estimate(estimated, measured)
    # the replicas write nothing: one shard per partition, and the meta
    assert runs[0]["hybrid files"] == ["zero_meta.pt", "zero_shard_00000.pt",
                                       "zero_shard_00001.pt"]


def test_a_hybrid_checkpoint_loads_on_other_layouts(runs, kept, monkeypatch):
    """Saved on 2 x 2 at stage 3; loaded, bit for bit, on 4 ranks without a
    mesh, on 4 x 1 and 1 x 4 meshes, on a half of the world, and in one
    process."""
    saved = runs[0][("hybrid", 3)][1]
    for rank in range(4):
        for layout, state in runs[rank]["loaded"].items():
            assert all(torch.equal(state[k], saved[k]) for k in saved), (rank, layout)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    state = loaded_state(str(kept / "stage3"), 2)
    assert all(torch.equal(state[k], saved[k]) for k in saved)


def test_a_mesh_whose_replicas_hold_other_partitions_is_refused(runs):
    """[[0, 3], [2, 1]]: rows {0, 3} and {1, 2} (a group's ranks are
    sorted, so rank 2 is place 1 of its row), columns {0, 2} and {3, 1}:
    each column joins place 0 of one row with place 1 of the other, whose
    gradients would be summed. Refused on every rank, before training."""
    for rank in range(4):
        assert runs[rank]["crossed"] is not None and \
            "replicas must hold the same partition" in runs[rank]["crossed"], runs[rank]["crossed"]


def test_the_mesh_dimensions_may_come_in_either_order(runs):
    """("dp_shard", "dp_replicate") names the same groups as the transposed
    ("dp_replicate", "dp_shard") mesh: the same training, bit for bit."""
    for rank in range(4):
        losses, state, _consolidated, _comm = runs[rank][("hybrid reversed", 3)]
        same_losses, same_state, _c, _m = runs[rank][("hybrid", 3)]
        assert losses == same_losses
        assert all(torch.equal(state[k], same_state[k]) for k in state)


def test_a_group_without_this_rank_is_refused_by_name(runs):
    for rank in (2, 3):
        group_error, mesh_error = runs[rank]["not a member"]
        assert f"this rank ({rank}) is not one of the group's ranks" in group_error
        assert f"this rank ({rank}) is not in the DeviceMesh [0, 1]" in mesh_error


def test_ranks_that_pass_other_meshes_are_refused_on_every_rank(runs):
    """A 2 x 2 mesh on ranks 0-1 and a 1 x 4 one on ranks 2-3, or None on
    rank 3: initialize went on into collectives on groups that never pair
    and every rank waited out the process group's timeout (mesh hunt). The
    engine's first gather compares the meshes: a ValueError naming `mesh`
    on every rank, at once."""
    for rank in range(4):
        shape, world = runs[rank]["other meshes"]
        assert shape is not None and shape.startswith("mesh: the ranks passed other meshes") \
            and f"rank(s) {[2, 3] if rank < 2 else [0, 1]} another" in shape, shape
        assert world is not None and f"rank(s) {[3] if rank < 3 else [0, 1, 2]} another" in \
            world, world
        if rank == 3:
            assert "passed the whole world (4 ranks; mesh=None)" in world

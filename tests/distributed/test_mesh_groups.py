"""zero.initialize(mesh=...): ZeRO over a part of the world. On 4 gloo
ranks, ranks {0, 1} and {2, 3} train two different models at once, each
half its own engine over its own group (a ProcessGroup, or the 1-D
DeviceMesh of a 2 x 2 mesh's "dp_shard" dimension), at stages 0-3, and
each is compared with a single-process torch reference of its model
(tests/distributed/scenarios.py: tied, frozen, reused and unused
parameters, sizes 2 does not divide, two param groups). Tolerance as in
test_engine_parity.py: 1e-5 normwise relative error in fp32 (gradients
summed in another order than one process sums them, a few ulps a step).
Each half also saves a checkpoint into a directory of its own, which
consolidates to what its engine holds."""
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

import harness
import scenarios
from conftest import max_rel_error

STEPS = 6
STAGES = [0, 1, 2, 3]
SEEDS = (0, 5)  # the model of ranks {0, 1}, of ranks {2, 3}


def train_on_group(group, seed, stage, steps, opt="adamw", lr=1e-2, save_dir=None,
                   **options):
    """scenarios.engine_run on a group: its ranks shard each batch, its
    loss is averaged over it."""
    import torch.distributed as dist
    import zero
    pg = group.get_group() if hasattr(group, "get_group") else group  # a 1-D DeviceMesh
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    model = scenarios.make_model(seed)
    engine = zero.initialize(model, optimizer=scenarios.make_optimizer(opt, model, lr),
                             stage=stage, mesh=group, **options)
    assert engine._comm.world == 2 and engine._comm.rank == dist.get_rank() % 2
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
    engine.close()
    return losses, state, consolidated


def _halves(rank, world):
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
        dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def runs():
    return harness.run(4, _halves, timeout=600)


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
            losses, state, consolidated = runs[rank][(case, stage)]
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

"""Optimizer settings that differ between pipeline stages, on pp=2 (2
ranks, examples/gpt.py's GPT with its head tied to the embedding):

- a tied copy trained otherwise than the parameter it copies (the head's
  copy frozen on the last stage alone, or in a param group of another
  learning rate) is refused at initialize on every rank ([Note: tied
  copies alike] in parallel/_pipeline.py); before, it drifted from the
  embedding silently;
- a param group whose settings differ between the stages is refused by
  save_checkpoint on every rank, before any tag is written (merged, the
  first stage's settings replaced the others' at the next load); the
  same learning rates as groups of their own on each stage (an empty group
  where a stage holds none of them) save, and load back stage by stage."""
import os

import pytest
import torch

import harness
from parallel_cases import make_model, mesh_of


def _stage(mesh):
    import zero
    return zero.parallel.split_gpt(make_model(), mesh["pp"])


def _refused_at_initialize(mesh, freeze_copy: bool) -> str:
    import zero
    part = _stage(mesh)
    last = mesh["pp"].get_local_rank() == 1
    trained = [p for p in part.parameters() if p.requires_grad]
    if freeze_copy and last:
        part.head.weight.requires_grad_(False)
        groups = [{"params": [p for p in trained if p is not part.head.weight]}]
    elif not freeze_copy and last:  # the copy in a group of its own, at another lr
        groups = [{"params": [p for p in trained if p is not part.head.weight]},
                  {"params": [part.head.weight], "lr": 0.01}]
    else:
        groups = [{"params": trained}, {"params": []}] if not freeze_copy else \
            [{"params": trained}]
    try:
        zero.initialize(part, optimizer=torch.optim.SGD(groups, lr=0.05), stage=1, mesh=mesh)
    except ValueError as error:
        return str(error)
    return "accepted"


def _train_and_save(mesh, optimizer_of, directory):
    """Two batches through the pipeline, then save_checkpoint: (None or
    the error's text, the engine)."""
    import zero
    part = _stage(mesh)
    engine = zero.initialize(part, optimizer=optimizer_of(part), stage=1, mesh=mesh)
    pipe = zero.parallel.pipeline_schedule(engine, mesh["pp"], 2, zero.parallel.gpt_loss)
    for step in range(2):
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
        if mesh["pp"].get_local_rank() == 0:
            pipe.step(ids)
        else:
            pipe.step(target=torch.roll(ids, -1, 1), losses=[])
        engine.step()
    try:
        engine.save_checkpoint(directory, tag="t")
        return None, engine
    except (ValueError, RuntimeError) as error:
        return str(error), engine


def _worker(rank, world, directory):
    import torch.distributed as dist
    import zero
    dist.init_process_group("gloo")
    mesh = mesh_of((2,), ("pp",))
    out = {"frozen copy": _refused_at_initialize(mesh, True),
           "copy's group": _refused_at_initialize(mesh, False)}
    lr = 0.05 if rank == 0 else 0.01

    def split(part):  # (the stage's untied trained parameters, its side of the tie)
        tie = part.embed.weight if rank == 0 else part.head.weight
        return [p for p in part.parameters() if p.requires_grad and p is not tie], tie

    def one_group(part):  # group 0's lr differs between the stages
        untied, tie = split(part)
        return torch.optim.SGD([{"params": untied, "lr": lr}, {"params": [tie]}], lr=0.05,
                               momentum=0.9)
    error, engine = _train_and_save(mesh, one_group, os.path.join(directory, "one"))
    out["one group"] = error
    out["one group's tags"] = sorted(os.listdir(os.path.join(directory, "one"))) \
        if os.path.isdir(os.path.join(directory, "one")) else []
    engine.close()

    def own_groups(part):  # each stage's lr in a group of its own
        untied, tie = split(part)
        mine, other = {"params": untied, "lr": lr}, {"params": [], "lr": 0.05 + 0.01 - lr}
        return torch.optim.SGD([mine, other, {"params": [tie]}] if rank == 0 else
                               [other, mine, {"params": [tie]}], lr=0.05, momentum=0.9)
    error, engine = _train_and_save(mesh, own_groups, os.path.join(directory, "own"))
    out["own groups"] = error
    engine.close()
    part = _stage(mesh)
    fresh = own_groups(part)
    for group in fresh.param_groups:
        group["lr"] = 1.0  # the load must set each stage's own
    engine = zero.initialize(part, optimizer=fresh, stage=1, mesh=mesh)
    engine.load_checkpoint(os.path.join(directory, "own"), tag="t")
    out["loaded lrs"] = [g["lr"] for g in engine.optimizer.param_groups]
    engine.close()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return harness.run(2, _worker, str(tmp_path_factory.mktemp("pp_settings")), timeout=300)


def test_a_tied_copy_trained_otherwise_is_refused_on_every_rank(results):
    for out in results:
        for case in ("frozen copy", "copy's group"):
            assert "the tied parameter 'embed.weight' is trained differently" in out[case], \
                (case, out[case])
    assert "requires_grad=False" in results[1]["frozen copy"]
    assert "lr=0.01" in results[1]["copy's group"]


def test_settings_that_differ_between_stages_are_refused_by_the_save(results):
    assert "give param group 0 different settings (lr 0.05 and 0.01)" in \
        results[0]["one group"]
    assert "failed on 1 other rank" in results[1]["one group"]
    assert all("t" not in out["one group's tags"] for out in results)


def test_groups_of_their_own_save_and_load_stage_by_stage(results):
    assert results[0]["own groups"] is None and results[1]["own groups"] is None
    # each group's lr is the stage's that holds its parameters
    assert results[0]["loaded lrs"] == results[1]["loaded lrs"] == [0.05, 0.01, 0.05]

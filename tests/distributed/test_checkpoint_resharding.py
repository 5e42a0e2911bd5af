"""Checkpoints across world sizes and stages, on real gloo processes: a
6-step run is cut in legs, saved at one world size and stage, loaded at
another, and must end where the single-process torch reference ends.

Legs: 3 steps on 2 ranks, save; 3 steps on 3 ranks after loading (or 2
steps, save, and the last step in one process). Tolerance, fp32: max
relative error 1e-5, as in test_engine_parity.py (the ranks sum in
another order than one process, and the C AdamW differs from torch's by a
few ulps a step). Restoring itself is exact: right after a load the master
equals what was saved, bit for bit.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import harness
import scenarios
from conftest import max_rel_error

# name: (engine_run options of both legs, save stage, load stage, reference options)
CASES = {
    "stage 3 -> 1, accumulation, clip": (dict(accumulation=2, clip=0.05), 3, 1,
                                         dict(accumulation=2, clip=0.05)),
    "stage 1 -> 3, sgd": (dict(opt="sgd", lr=0.1), 1, 3, dict(opt="sgd", lr=0.1)),
    "stage 2 -> 0": (dict(), 2, 0, dict()),
}


def _save_legs(rank, world, root):
    out = {}
    for i, (name, (options, stage, _, _)) in enumerate(CASES.items()):
        out[name] = scenarios.engine_run(rank, world, 3, stage, save_dir=f"{root}/case{i}",
                                         **options)
    # for the chain 2 ranks -> 3 ranks -> 1 process
    scenarios.engine_run(rank, world, 3, 0, save_dir=f"{root}/chain")
    out["bf16"] = scenarios.engine_run(rank, world, 3, 2, precision="bf16",
                                       save_dir=f"{root}/bf16")
    out["failure"] = _failing_save(rank, root)
    return out


def _failing_save(rank, root):
    """Rank 1's disk fails while saving: every rank must raise (none may
    wait forever for it), no 'latest' may name the broken checkpoint, and
    the next save must work. Then a save into directories that are not
    one: refused on every rank, nothing published."""
    import zero
    model = scenarios.make_model()
    engine = zero.initialize(model, optimizer=scenarios.make_optimizer("adamw", model, 1e-2),
                             stage=2)
    real_save = torch.save

    def broken(obj, path, *args, **kwargs):
        raise OSError(f"no space left on device (test): {path}")
    torch.save = broken if rank == 1 else real_save
    try:
        engine.save_checkpoint(f"{root}/failure", tag="broken")
        error = None
    except Exception as e:  # noqa: BLE001 - the message is the result
        error = f"{type(e).__name__}: {e}"
    finally:
        torch.save = real_save
    latest_after_failure = os.path.exists(f"{root}/failure/latest")
    engine.save_checkpoint(f"{root}/failure", tag="good")
    # ranks that do not share the directory (each machine's local disk):
    # rank 1 writes its shard where rank 0 never sees it
    try:
        engine.save_checkpoint(f"{root}/failure" if rank == 0 else f"{root}/elsewhere",
                               tag="apart")
        apart = None
    except RuntimeError as e:
        apart = str(e)
    engine.close()
    return error, latest_after_failure, apart


def _load_legs(rank, world, root):
    out = {}
    for i, (name, (options, _, stage, _)) in enumerate(CASES.items()):
        out[name] = scenarios.engine_run(rank, world, 3, stage, first_step=3,
                                         load_dir=f"{root}/case{i}", **options)
    scenarios.engine_run(rank, world, 2, 2, first_step=3, load_dir=f"{root}/chain",
                         save_dir=f"{root}/chain3")
    out["bf16"] = scenarios.engine_run(rank, world, 1, 3, precision="bf16", first_step=3,
                                       load_dir=f"{root}/bf16")
    return out


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpoints"))
    saved = harness.run(2, _save_legs, root)
    loaded = harness.run(3, _load_legs, root)
    return root, saved, loaded


@pytest.mark.parametrize("name", list(CASES))
def test_resumed_run_matches_torch(legs, name):
    _root, saved, loaded = legs
    reference_options = CASES[name][3]
    ref_losses, ref_state = scenarios.reference_run(6, **reference_options)
    first_losses = saved[0][name][0]
    losses, state, facts = loaded[0][name]
    for ours, ref in zip(first_losses + losses, ref_losses, strict=True):
        assert abs(ours - ref) <= 1e-5 * abs(ref)
    for key, ref in ref_state.items():
        assert max_rel_error(state[key], ref) <= 1e-5, key
    # restoring is exact: the loaded master is the saved one
    saved_state = saved[0][name][1]
    for key in saved_state:
        assert torch.equal(facts["loaded"][key], saved_state[key]), key


def test_bf16_restores_exactly_at_another_world_and_stage(legs):
    _root, saved, loaded = legs
    saved_state = saved[0]["bf16"][1]
    for rank in range(3):
        loaded_state = loaded[rank]["bf16"][2]["loaded"]
        for key in saved_state:
            assert torch.equal(loaded_state[key], saved_state[key]), key


def test_chain_of_world_sizes_ends_in_one_process(legs):
    """2 ranks (stage 0) -> 3 ranks (stage 2) -> one process (stage 3,
    no launcher), then the last step."""
    root, _saved, _loaded = legs
    ref_losses, ref_state = scenarios.reference_run(6)
    losses, state, _facts = scenarios.engine_run(0, 1, 1, 3, first_step=5,
                                                 load_dir=f"{root}/chain3")
    assert abs(losses[0] - ref_losses[5]) <= 1e-5 * abs(ref_losses[5])
    for key, ref in ref_state.items():
        assert max_rel_error(state[key], ref) <= 1e-5, key


def test_consolidated_checkpoint_continues_in_plain_torch(legs):
    """The 2-rank stage-3 checkpoint, consolidated with no process group,
    loads into a torch model and torch.optim.AdamW, and 3 more steps in
    plain torch end where the uninterrupted torch run ends."""
    from zero.checkpoint import consolidate
    root, _saved, _loaded = legs
    state = consolidate(f"{root}/case0")
    model = scenarios.make_model(seed=123)  # other values: all must come from the file
    model.load_state_dict(state["model"], strict=True)
    opt = scenarios.make_optimizer("adamw", model, 1e-2)
    opt.load_state_dict(state["optimizer"])
    for p in model.parameters():  # as the reference's zero_grad(set_to_none=False)
        if p.requires_grad:       # leaves them: the unused branch still steps
            p.grad = torch.zeros_like(p)
    for step in range(3, 6):
        ids, labels = scenarios.batch(step)
        opt.zero_grad(set_to_none=False)
        for ids_m, labels_m in zip(ids.chunk(2), labels.chunk(2)):
            (F.cross_entropy(model(ids_m, use_branch=step % 2 == 0), labels_m) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    _losses, ref_state = scenarios.reference_run(6, accumulation=2, clip=0.05)
    for key, ref in ref_state.items():
        assert max_rel_error(model.state_dict()[key], ref) <= 1e-5, key


def test_a_failed_save_raises_on_every_rank(legs):
    root, saved, _loaded = legs
    error0, latest0, apart0 = saved[0]["failure"]
    error1, _, apart1 = saved[1]["failure"]
    assert error1.startswith("OSError: cannot write checkpoint file") and \
        "no space left on device (test)" in error1
    assert error0 == "RuntimeError: saving the checkpoint failed on 1 other rank(s); " \
                     "see their errors"
    assert not latest0
    with open(f"{root}/failure/latest") as f:
        assert f.read() == "good"
    # directories apart: refused on both ranks before anything is published
    assert "1 of the 2 files the ranks wrote are not in" in apart0 and \
        "a shared filesystem" in apart0, apart0
    assert apart1 == "saving the checkpoint failed on 1 other rank(s); see their errors"
    assert not os.path.exists(f"{root}/failure/apart")

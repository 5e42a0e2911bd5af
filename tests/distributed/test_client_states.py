"""Each rank's own client_state at stage 3, rank 0's at stages 0-2, as
DeepSpeed gives them back ([Note: per-rank client_state] in
checkpoint/_client_states.py), on real gloo processes: saved on 2 ranks,
loaded on 2 (each its own), on 1 and 3 (rank 0's, with a warning); a
client_state every rank gives alike costs no file; a client_state file of
another save, or missing, is refused on every rank before anything loads."""
import os
import shutil
import warnings

import pytest
import torch
from torch import nn

import harness


def _engine(stage):
    import zero
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                           stage=stage)


def _own_state(rank):
    """What a script keeps per rank: its RNG state, a data position."""
    torch.manual_seed(1000 + rank)
    return {"epoch": 3, "rank": rank, "rng": torch.get_rng_state(), "seen": [rank, 7 * rank]}


def _save(rank, world, root):
    for stage in (2, 3):
        engine = _engine(stage)
        engine.backward(engine(torch.randn(8, 16)).square().mean())
        engine.step()
        engine.save_checkpoint(f"{root}/stage{stage}", client_state=_own_state(rank))
        engine.save_checkpoint(f"{root}/alike{stage}", client_state={"epoch": 3})
        engine.close()


def _load(rank, world, root, stage):
    """(client_state, warnings) of a fresh stage-3 engine's load."""
    engine = _engine(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _path, state = engine.load_checkpoint(f"{root}/stage{stage}")
        except Exception as error:  # noqa: BLE001  every rank's refusal is compared
            state = f"{type(error).__name__}: {error}"
    engine.close()
    return state, [str(w.message) for w in caught if "client_state" in str(w.message)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("client_states"))
    harness.run(2, _save, root)
    return root


def _same(state, expected):
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key
        else:
            assert state[key] == value, key


def test_stage_3_gives_each_rank_its_own(saved):
    files = sorted(f for f in os.listdir(f"{saved}/stage3/global_step1")
                   if f.startswith("zero_client"))
    assert files == ["zero_client_00000.pt", "zero_client_00001.pt"]
    for rank, (state, caught) in enumerate(harness.run(2, _load, saved, 3)):
        _same(state, _own_state(rank))
        assert caught == []


def test_stages_0_2_give_rank_0s(saved):
    assert not any(f.startswith("zero_client") for f in os.listdir(f"{saved}/stage2/global_step1"))
    for state, caught in harness.run(2, _load, saved, 2):
        _same(state, _own_state(0))
        assert caught == []


def test_a_client_state_every_rank_gives_alike_costs_no_file(saved):
    for stage in (2, 3):
        assert not any(f.startswith("zero_client")
                       for f in os.listdir(f"{saved}/alike{stage}/global_step1"))


@pytest.mark.parametrize("world", [1, 3])
def test_another_world_size_gets_rank_0s_with_a_warning(saved, world):
    for rank, (state, caught) in enumerate(harness.run(world, _load, saved, 3)):
        _same(state, _own_state(0))
        if rank == 0:
            assert len(caught) == 1 and "each of the 2 ranks" in caught[0] and \
                f"this run has {world}" in caught[0], caught
        else:
            assert caught == []


def _copy_of(saved, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    return str(copy)


def test_a_client_state_file_of_another_save_is_refused_everywhere(saved, tmp_path):
    copy = _copy_of(saved, tmp_path)
    # rank 1's file from the checkpoint of another save
    shutil.copy(f"{saved}/alike3/global_step1/zero_shard_00001.pt",
                f"{copy}/stage3/global_step1/zero_client_00001.pt")
    states = [state for state, _ in harness.run(2, _load, copy, 3)]
    assert "belongs to another save" in states[1], states[1]
    assert states[0].startswith("RuntimeError: loading the checkpoint failed on 1 other"), \
        states[0]


def test_a_missing_client_state_file_is_refused_everywhere(saved, tmp_path):
    copy = _copy_of(saved, tmp_path)
    os.remove(f"{copy}/stage3/global_step1/zero_client_00000.pt")
    states = [state for state, _ in harness.run(2, _load, copy, 3)]
    assert "zero_client_00000.pt' is missing" in states[0], states[0]
    assert states[1].startswith("RuntimeError: loading the checkpoint failed on 1 other"), \
        states[1]


def test_swapped_client_state_files_are_refused(saved, tmp_path):
    """Files of one save, renamed to each other's ranks: each rank would get
    its peer's state."""
    copy = _copy_of(saved, tmp_path)
    tag = f"{copy}/stage3/global_step1"
    os.rename(f"{tag}/zero_client_00000.pt", f"{tag}/swap")
    os.rename(f"{tag}/zero_client_00001.pt", f"{tag}/zero_client_00000.pt")
    os.rename(f"{tag}/swap", f"{tag}/zero_client_00001.pt")
    for state, _ in harness.run(2, _load, copy, 3):
        assert "is not rank" in state or "failed on 1 other" in state, state

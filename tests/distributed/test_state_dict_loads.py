"""model.load_state_dict(...) at stage 3 while the engine trains ([Note:
state dict loads at stage 3] in sharding/_state_loads.py), on 1 and 2 gloo
ranks: every rank loads the same values after a step; the engine's
weights are then exactly those values and the next steps match a torch
model and optimizer that made the same load. A state dict with a few keys
(strict=False) changes those parameters alone and gathers only their
units. Before, every released parameter was refused on its shape
("size mismatch ... torch.Size([0])")."""
import pytest
import torch

import harness
from conftest import max_rel_error
from scenarios import blocks_batches, make_blocks


def _new_values(only=None):
    """The values every rank loads (shaped as a plain model's: the engine's
    model holds placeholders)."""
    g = torch.Generator().manual_seed(11 if only is None else 12)
    return {k: torch.randn(v.shape, generator=g) * 0.1
            for k, v in make_blocks().state_dict().items()
            if only is None or k.startswith(only)}


def _train(rank, world, threshold):
    import zero
    model = make_blocks()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=3, stage3_param_persistence_threshold=threshold)
    mine, _ = blocks_batches(rank, world, steps=3)
    engine.backward(engine(mine[0]))
    engine.step()
    model.load_state_dict(_new_values())
    loaded = engine.full_state_dict()
    gathered_before = engine._schedule.counts["on_demand"]
    model.load_state_dict(_new_values(only="blocks.2."), strict=False)
    gathered_by_partial = engine._schedule.counts["on_demand"] - gathered_before
    partial = engine.full_state_dict()
    for ids in mine[1:]:
        engine.backward(engine(ids))
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return loaded, partial, gathered_by_partial, state


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("threshold", [0, 10**5], ids=["released", "persistent"])
def test_load_state_dict_at_stage_3(world, threshold):
    runs = harness.run(world, _train, threshold)
    ref = make_blocks()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    every = blocks_batches(0, world, steps=3)[1]
    opt.zero_grad()
    ref(every[0]).backward()
    opt.step()
    new = _new_values()
    ref.load_state_dict(new)
    ref.load_state_dict(_new_values(only="blocks.2."), strict=False)
    after_partial = {k: v.clone() for k, v in ref.state_dict().items()}
    for ids in every[1:]:
        opt.zero_grad()
        ref(ids).backward()
        opt.step()
    for loaded, partial, gathered_by_partial, state in runs:
        for name, value in new.items():
            assert torch.equal(loaded[name], value), name
        for name, value in after_partial.items():
            assert torch.equal(partial[name], value), name
        # one unit (the block) gathered for the partial load, when released
        assert gathered_by_partial == (1 if threshold == 0 else 0)
        for name, value in ref.state_dict().items():
            assert max_rel_error(state[name], value) < 1e-5, name


def _load_on_rank_0(rank, world):
    """HuggingFace's pattern under DeepSpeed stage 3: every rank enters
    GatheredParameters(modifier_rank=0), rank 0 alone loads. The load's
    hooks see the units gathered and make no collective of their own."""
    import zero
    model = make_blocks()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0)
    with zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            model.load_state_dict(_new_values())
    state = engine.full_state_dict()
    engine.close()
    return state


def test_a_load_on_one_rank_inside_gathered_parameters():
    new = _new_values()
    for state in harness.run(2, _load_on_rank_0, timeout=120):
        for name, value in new.items():
            assert torch.equal(state[name], value), name

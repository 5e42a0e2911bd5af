"""torch.distributed.checkpoint's get_state_dict, get_optimizer_state_dict
and set_optimizer_state_dict on an engine's model and optimizer (its own,
or the HF Trainer's stand-in): refused with what to save or load with
instead, and the run goes on as if they had not been called ([Note: DCP's
preparation] in engine/_dcp_preparation.py: DCP set every lr to 0 before
the refusal, and a script that caught the error trained on at lr 0)."""
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict)

import zero


def engine_and_batch(stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2},
                                   {"params": model[2].parameters(), "lr": 3e-3}])
    engine = zero.initialize(model, optimizer=optimizer, stage=stage,
                             stage3_param_persistence_threshold=0)
    return engine, torch.randn(8, 8), torch.randn(8, 4)


def train(engine, x, y):
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()


def load_into(model, optimizer):
    set_optimizer_state_dict(model, optimizer, {"state": {}, "param_groups": [
        {"lr": 0.5, "params": [0, 1]}, {"lr": 0.5, "params": [2, 3]}]})


def trainers_optimizer(engine):
    """What the HF Trainer's optimizer is under ZeroTrainerMixin: a
    stand-in whose step is engine.step()."""
    from zero.integrations.hf import _EngineOptimizer
    return _EngineOptimizer(engine)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("call,says", [(get_state_dict, "engine.save_checkpoint"),
                                       (get_optimizer_state_dict, "engine.save_checkpoint"),
                                       (load_into, "engine.load_checkpoint")])
@pytest.mark.parametrize("optimizer", ["its own", "the Trainer's"])
def test_dcp_refusal_leaves_the_run_as_it_was(stage, call, says, optimizer):
    engine, x, y = engine_and_batch(stage)
    twin, _, _ = engine_and_batch(stage)
    train(engine, x, y)
    train(twin, x, y)
    given = engine.optimizer if optimizer == "its own" else trainers_optimizer(engine)
    # (stage 1 keeps .grad, so DCP skips its preparation and meets the
    # refusal of optimizer.state_dict(), which names save_checkpoint)
    with pytest.raises(RuntimeError, match=says if stage > 1 else "engine.save_checkpoint"):
        call(engine.module, given)
    assert [g["lr"] for g in engine.optimizer.param_groups] == [1e-2, 3e-3]
    train(engine, x, y)  # caught, trained on: as if never called
    train(twin, x, y)
    ours, theirs = engine.full_state_dict(), twin.full_state_dict()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    engine.close()
    twin.close()

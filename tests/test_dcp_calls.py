"""torch.distributed.checkpoint's get_state_dict on an engine's model and
optimizer: refused with what to save with instead, and the run goes on as
if it had not been called ([Note: DCP's preparation] in
engine/_dcp_preparation.py: DCP set every lr to 0 before the refusal, and
a script that caught the error trained on at lr 0)."""
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict

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


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("call", [get_state_dict, get_optimizer_state_dict])
def test_dcp_refusal_leaves_the_run_as_it_was(stage, call):
    engine, x, y = engine_and_batch(stage)
    twin, _, _ = engine_and_batch(stage)
    train(engine, x, y)
    train(twin, x, y)
    with pytest.raises(RuntimeError, match="engine.save_checkpoint"):
        call(engine.module, engine.optimizer)
    assert [g["lr"] for g in engine.optimizer.param_groups] == [1e-2, 3e-3]
    train(engine, x, y)  # caught, trained on: as if never called
    train(twin, x, y)
    ours, theirs = engine.full_state_dict(), twin.full_state_dict()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    engine.close()
    twin.close()

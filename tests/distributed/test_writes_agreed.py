"""Writes into the parameters after initialize, on 2 gloo ranks ([Note:
writes agreed] in _step_agreement.py): a write made on one rank only, or
with other values on each rank, is refused on every rank at the next step
(before, each rank took its own values into its own slice, silently
mixing two models); the same write on every rank is taken in."""
import pytest

import harness

STAGES = [0, 1, 2, 3]


def writes(rank, world):
    import torch
    from torch import nn
    import zero
    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 stage=stage, stage3_param_persistence_threshold=100)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))

        def step():
            engine.backward(engine(x).square().mean())
            engine.step()
        step()
        errors = []
        persistent = model[0]  # 56 elements: gathered for good at stage 3 too
        with torch.no_grad():
            if rank == 0:  # one rank only
                persistent.weight.fill_(0.5)
        try:
            step()
        except RuntimeError as e:
            errors.append(str(e))
        engine.zero_grad()
        with torch.no_grad():  # every rank, other values
            torch.nn.init.normal_(persistent.bias, generator=torch.Generator().manual_seed(rank))
        try:
            step()
        except RuntimeError as e:
            errors.append(str(e))
        engine.zero_grad()
        with torch.no_grad():  # every rank alike: taken in
            persistent.weight.fill_(0.25)
            persistent.bias.fill_(0.125)
        before = engine.full_state_dict()
        step()
        out[stage] = (errors, before, engine.full_state_dict())
        engine.close()
    return out


@pytest.fixture(scope="module")
def results():
    return harness.run(2, writes, timeout=240)


@pytest.mark.parametrize("stage", STAGES)
def test_writes_must_agree(results, stage):
    import torch
    for rank, out in enumerate(results):
        errors, before, after = out[stage]
        assert len(errors) == 2, (rank, errors)
        for message in errors:
            assert "not alike on every rank" in message and "Nothing was taken in" in message
        assert "'0.weight'" in errors[0] if rank == 0 else "wrote none" in errors[0]
        assert "'0.bias'" in errors[1]
        assert torch.equal(before["0.weight"], torch.full((8, 6), 0.25))
        assert torch.equal(before["0.bias"], torch.full((8,), 0.125))
    # the ranks trained one model on
    for key, value in results[0][stage][2].items():
        assert torch.equal(results[1][stage][2][key], value), key

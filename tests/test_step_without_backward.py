"""engine.step() at an update that no gradient reached (no backward since
the last update, or a zero_grad() that dropped them) warns, at every
stage: the update runs on zero gradients, so a loop that forgot
engine.backward(loss) trained on nothing but weight decay, silently
(DeepSpeed fails there with a KeyError or IndexError). A plain
loss.backward() counts: at stages 0-1 it is seen by the flat gradient
buffer's version counter, at stages 2-3 by the backward's hooks."""
import warnings

import pytest
import torch
from torch import nn

import zero
from engine_cases import no_launcher

WARNED = "engine.step\\(\\) updates with no backward since the last update"


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    no_launcher(monkeypatch)


def engine_of(stage, accumulation=1):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           stage=stage, gradient_accumulation_steps=accumulation)


def quiet_steps(engine, backward, count=2):
    """`count` micro-steps with a backward each; returns the warnings."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(count):
            backward(engine(torch.randn(3, 4)).sum())
            engine.step()
    return [w for w in seen if "no backward since" in str(w.message)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_with_no_gradient_warns(stage):
    engine = engine_of(stage, accumulation=2)
    # the first update, before any gradient
    engine(torch.randn(3, 4)).sum()
    engine.step()  # a micro-step: no update, no warning
    with pytest.warns(UserWarning, match=WARNED) as caught:
        engine.step()
    assert caught[0].filename == __file__  # named at the user's line
    assert engine.global_steps == 1
    # engine.backward and a plain loss.backward() both count
    assert quiet_steps(engine, engine.backward) == []
    assert quiet_steps(engine, lambda loss: loss.backward()) == []
    # gradients dropped by zero_grad() between the backward and the step
    engine.backward(engine(torch.randn(3, 4)).sum())
    engine.step()
    engine.backward(engine(torch.randn(3, 4)).sum())
    engine.zero_grad()
    with pytest.warns(UserWarning, match=WARNED):
        engine.step()
    # and a backward after a zero_grad() counts again
    engine.zero_grad()
    assert quiet_steps(engine, engine.backward) == []
    engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_the_zero_gradient_update_is_what_it_says(stage):
    """The update runs on zero gradients: an SGD step without momentum nor
    weight decay leaves the parameters as they were."""
    engine = engine_of(stage)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    with pytest.warns(UserWarning, match=WARNED):
        engine.step()
    after = engine.full_state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    engine.close()

"""zero.initialize again after the model changed which parameters train or
their shapes, as the step's refusals advise (advice hunt): the refusals
that a new engine would meet come before the old engine is closed, and a
parameter resized since initialize is kept as resized by close() (the old
engine's values of it, written back, undid the resize silently). Checked
against plain torch doing the same run."""
import pytest
import torch
from torch import nn

import zero
from conftest import max_rel_error


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.emb(ids)))).mean(1)


def batch(k):
    g = torch.Generator().manual_seed(k)
    return torch.randint(0, 20, (4, 5), generator=g), torch.randn(4, 3, generator=g)


def step(run, model, k):
    ids, y = batch(k)
    loss = (model(ids) - y).square().mean()
    if isinstance(run, torch.optim.Optimizer):
        run.zero_grad()
        loss.backward()
        run.step()
    else:
        run.backward(loss)
        run.step()


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    from engine_cases import no_launcher
    no_launcher(monkeypatch)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unfreezing_with_the_same_optimizer_is_refused_before_the_engine_closes(stage):
    model = Net()
    model.emb.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = zero.initialize(model, optimizer=optimizer, stage=stage)
    step(engine, model, 0)
    model.emb.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="param groups of their own"):
        step(engine, model, 1)
    with pytest.raises(ValueError, match="'emb.weight' trains now but did not.*group 0 has "
                                         "states at step 1.*The engine is left as it was"):
        zero.initialize(model, optimizer=optimizer, stage=stage)
    assert not engine._closed
    model.emb.weight.requires_grad_(False)
    step(engine, model, 1)  # trains on
    engine.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unfreezing_a_parameter_in_a_group_of_its_own_matches_torch(stage):
    """The advised route: the parameter to unfreeze in a param group of its
    own; that group starts afresh at the new initialize, as torch's per
    parameter states do."""
    def run(make_engine):
        model = Net()
        model.emb.weight.requires_grad_(False)
        optimizer = torch.optim.AdamW(
            [{"params": [model.emb.weight]},
             {"params": [*model.body.parameters(), *model.head.parameters()]}], lr=1e-2)
        runner = make_engine(model, optimizer)
        for k in range(2):
            step(runner, model, k)
        model.emb.weight.requires_grad_(True)
        runner = make_engine(model, optimizer)
        for k in range(2, 4):
            step(runner, model, k)
        if not isinstance(runner, torch.optim.Optimizer):
            runner.close()
        return model.state_dict()
    ours = run(lambda model, opt: zero.initialize(model, optimizer=opt, stage=stage))
    theirs = run(lambda model, opt: opt)
    for key, value in theirs.items():
        assert max_rel_error(ours[key], value) <= 1e-5, key


@pytest.mark.parametrize("stage,precision", [(2, "fp32"), (2, "bf16"), (3, "fp32"),
                                             (3, "bf16")])
def test_a_resize_is_kept_by_close_and_trains_with_a_new_optimizer(stage, precision):
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = zero.initialize(model, optimizer=optimizer, stage=stage, precision=precision)
    step(engine, model, 0)
    trained = engine.full_state_dict()["emb.weight"].clone()
    with zero.GatheredParameters([model.emb.weight]):  # the rows as they are now
        grown = torch.cat([model.emb.weight.detach(), torch.zeros(2, 8,
                                                                  dtype=model.emb.weight.dtype)])
    model.emb.weight.data = grown
    with pytest.raises(RuntimeError, match="call it again after with a new optimizer"):
        step(engine, model, 1)
    with pytest.raises(ValueError, match=r"'emb.weight' was resized since the engine was made "
                                         r"\(\(20, 8\) -> \(22, 8\)\)"):
        zero.initialize(model, optimizer=optimizer, stage=stage, precision=precision)
    assert not engine._closed
    engine2 = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                              stage=stage, precision=precision)
    assert engine._closed
    weight = engine2.full_state_dict()["emb.weight"]
    assert weight.shape == (22, 8)
    # the trained rows: exact in fp32; in bf16 the resize copied the bf16
    # parameters, the master's values rounded (2^-8 relative at most)
    tolerance = 0.0 if precision == "fp32" else 2.0 ** -8
    assert max_rel_error(weight[:20].float(), trained.float()) <= tolerance
    step(engine2, model, 1)
    engine2.close()
    assert model.emb.weight.shape == (22, 8) and model.emb.weight.dtype == torch.float32

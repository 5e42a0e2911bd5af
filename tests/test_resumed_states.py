"""An optimizer that already holds states when zero.initialize takes it
over (a torch run resumed with optimizer.load_state_dict before
initialize): the engine starts from them, and while it trains, the
optimizer's own state_dict()/load_state_dict() are refused (they would
hold none of the engine's states, or change none). Reference: the torch
run continued without the engine (fp32; the C core's update against
torch's differs by rounding only, so 1e-6)."""
import copy
import re
import warnings

import pytest
import torch
from torch import nn

import zero
from conftest import max_rel_error
from engine_cases import no_launcher

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01),
    "zero_lion": lambda ps: zero.optim.Lion(ps, lr=1e-3, weight_decay=0.1),
}


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def data(count=6):
    return [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(count)]


def torch_steps(m, opt, inputs):
    for x in inputs:
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()


def resumed(name):
    """(torch model continued to the end, a copy of it and its optimizer
    as they were half-way, loaded from state dicts)."""
    m = model()
    opt = OPTIMIZERS[name](m.parameters())
    torch_steps(m, opt, data()[:3])
    saved_model, saved_opt = copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())
    torch_steps(m, opt, data()[3:])
    again = model()
    again.load_state_dict(saved_model)
    opt_again = OPTIMIZERS[name](again.parameters())
    opt_again.load_state_dict(saved_opt)
    return m, again, opt_again


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("stale_grad", [False, True], ids=["", "stale_grad"])
def test_the_engine_starts_from_the_optimizers_states(stage, name, stale_grad):
    """stale_grad: torch's loop zeroes before its backward, so its last
    .grad is still there at initialize; every stage starts from zero
    gradients (stages 2-3 added it into the first step)."""
    finished, m, opt = resumed(name)
    if stale_grad:
        m(data()[0]).square().mean().backward()
    engine = zero.initialize(m, optimizer=opt, stage=stage)
    assert len(opt.state) == 0  # no second copy of the states
    for x in data()[3:]:
        engine.backward(engine(x).square().mean())
        engine.step()
    state = engine.full_state_dict()
    for key, value in finished.state_dict().items():
        assert max_rel_error(state[key], value) <= 1e-6, key
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("then", ["reinitialize", "plain_torch"])
def test_close_gives_the_states_back(stage, name, then):
    """3 engine steps, close(), then 3 more by a new engine on the same
    optimizer (a re-run notebook cell) or by the optimizer itself: the
    same as 6 torch steps (before, the states were lost at close)."""
    m = model()
    finished = copy.deepcopy(m)
    torch_steps(finished, OPTIMIZERS[name](finished.parameters()), data())
    opt = OPTIMIZERS[name](m.parameters())
    engine = zero.initialize(m, optimizer=opt, stage=stage)
    for x in data()[:3]:
        engine.backward(engine(x).square().mean())
        engine.step()
    engine.close()
    assert len(opt.state) == len(list(m.parameters()))
    if then == "reinitialize":
        engine = zero.initialize(m, optimizer=opt, stage=stage)
        for x in data()[3:]:
            engine.backward(engine(x).square().mean())
            engine.step()
        engine.close()
    else:
        torch_steps(m, opt, data()[3:])
    for key, value in finished.state_dict().items():
        assert max_rel_error(m.state_dict()[key], value) <= 1e-6, key


def test_the_optimizers_state_dict_is_refused_while_the_engine_trains():
    m = model()
    opt = torch.optim.AdamW(m.parameters())
    engine = zero.initialize(m, optimizer=opt, stage=2)
    with pytest.raises(RuntimeError, match=r"optimizer.state_dict\(\) while a zero engine"):
        opt.state_dict()
    with pytest.raises(RuntimeError, match=r"optimizer.load_state_dict\(\) while a zero engine"):
        opt.load_state_dict({})
    engine.close()
    assert opt.state_dict()["param_groups"]  # the optimizer's own again


def test_states_the_engine_cannot_hold_are_refused():
    """One step count per group: parameters at different counts, or some
    without states, are named."""
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    torch_steps(m, opt, data()[:1])
    m[0].weight.grad = None
    m[0].bias.grad = None
    m[2](torch.randn(2, 16)).sum().backward()  # only the last layer steps again
    opt.step()
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(ValueError, match=r"param group 0: .*different step counts \(\[1, 2\]\)"):
        zero.initialize(m, optimizer=opt, stage=1)
    fresh = model()
    partial = torch.optim.Adam(fresh.parameters())
    fresh[2](torch.randn(2, 16)).sum().backward()
    partial.step()  # only the last layer has states
    with pytest.raises(ValueError, match="but not for 0.weight, 0.bias"):
        zero.initialize(fresh, optimizer=partial, stage=1)
    # refused before the model was touched
    assert [p.data_ptr() for p in m.parameters()] == before


def normed_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def bf16_engine_steps(engine, inputs):
    for x in inputs:
        engine.backward(engine(x).float().square().mean())
        engine.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["adamw", "zero_lion"])
def test_close_after_bf16_gives_the_fp32_model_back(stage, name):
    """A float32 model trained with precision="bf16" ([Note: dtypes given
    back] in engine/_handback.py): its fp32 masters start as the model's
    own values (not rounded to bf16); close() gives back float32
    parameters holding the masters exactly and float32 buffers; a new
    initialize on them goes on bit for bit as the run that was never
    closed (it was 2e-3 off, from bf16-rounded weights); torch's own step
    runs on them (it failed on bf16 parameters with fp32 states)."""
    options = dict(stage=stage, precision="bf16", stage3_param_persistence_threshold=0)
    m = normed_model()
    start = copy.deepcopy(m.state_dict())
    opt = OPTIMIZERS[name](m.parameters())
    engine = zero.initialize(m, optimizer=opt, **options)
    first = engine.full_state_dict()
    for key, value in dict(m.named_parameters()).items():
        assert torch.equal(first[key], start[key]), key
    bf16_engine_steps(engine, data()[:3])
    masters = engine.full_state_dict()
    engine.close()
    for key, p in m.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), masters[key]), key
    assert all(b.dtype == start[k].dtype for k, b in m.state_dict().items()), "buffers"
    again = copy.deepcopy(m)
    opt_again = OPTIMIZERS[name](again.parameters())
    opt_again.load_state_dict(opt.state_dict())
    engine = zero.initialize(m, optimizer=opt, **options)
    bf16_engine_steps(engine, data()[3:])
    resumed_state = engine.full_state_dict()
    engine.close()

    uninterrupted = normed_model()
    engine = zero.initialize(uninterrupted, optimizer=OPTIMIZERS[name](uninterrupted.parameters()),
                             **options)
    bf16_engine_steps(engine, data())
    for key, value in engine.full_state_dict().items():
        assert torch.equal(resumed_state[key], value), key
    engine.close()
    torch_steps(again, opt_again, data()[3:])  # plain torch goes on from what close() gave
    assert all(p.dtype == torch.float32 for p in again.parameters())


class Accumulating(torch.nn.Module):
    """A float64 buffer that adds 1e-9 a forward: float32 cannot hold it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.ones((), dtype=torch.float64))

    def forward(self, x):
        with torch.no_grad():
            self.total += 1e-9
        return self.lin(x)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_float64_buffer_keeps_its_dtype_at_fp32(tmp_path, stage):
    """At precision fp32 a float64 buffer is left as plain torch leaves it
    (it was cast to float32, and a thousand additions of 1e-9 vanished,
    silently); full_state_dict and checkpoints keep it float64. In 16 bits
    too ([Note: buffer dtypes]): until 2026-12-07 it was cast to bf16 with
    the parameters, with a warning."""
    m = Accumulating()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                             stage=stage)
    for _ in range(1000):
        engine(torch.randn(2, 4))
    assert m.total.dtype == torch.float64 and abs(m.total.item() - 1.000001) < 1e-12
    full = engine.full_state_dict()
    assert full["total"].dtype == torch.float64 and torch.equal(full["total"], m.total)
    engine.save_checkpoint(str(tmp_path))
    engine.close()
    assert torch.equal(zero.checkpoint.consolidate(tmp_path)["model"]["total"], full["total"])
    again = Accumulating()
    engine = zero.initialize(again, optimizer=torch.optim.SGD(again.parameters(), lr=0.1),
                             stage=stage)
    engine.load_checkpoint(str(tmp_path))
    assert torch.equal(again.total, full["total"])
    engine.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = zero.initialize(again, stage=stage, precision="bf16")
    engine(torch.randn(2, 4))
    assert again.total.dtype == torch.float64 and again.lin.weight.dtype == torch.bfloat16
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_close_gives_each_dtype_back(stage):
    """A bfloat16 model stays bfloat16 after close(), its torch optimizer's
    states in its dtype (torch's step needs them so); a float64 layer,
    trained in the engine's fp32, is float64 again."""
    m = model()
    m[0].bfloat16()
    m[2].double()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with pytest.warns(RuntimeWarning) as warned:
        engine = zero.initialize(m, optimizer=opt, stage=stage)
    said = [str(w.message) for w in warned]
    assert any(re.search(r"2 float64 parameter\(s\) \('2.weight' the first\) train in float32",
                         text) for text in said), said
    # a bf16 part of an fp32 model doubles its bytes: said too, with the way out
    assert any(re.search(r"2 torch.bfloat16 parameter\(s\) \('0.weight' the first\) are cast "
                         r"to torch.float32.*precision=\"bf16\"", text) for text in said), said
    for x in data()[:2]:
        engine.backward(engine(x).square().mean())
        engine.step()
    engine.close()
    assert [p.dtype for p in m.parameters()] == [torch.bfloat16] * 2 + [torch.float64] * 2
    for p in m.parameters():
        assert {t.dtype for k, t in opt.state[p].items() if k != "step"} == {p.dtype}
    x = data()[2]
    opt.zero_grad()
    m[2](m[1](m[0](x.bfloat16())).double()).square().mean().backward()
    opt.step()

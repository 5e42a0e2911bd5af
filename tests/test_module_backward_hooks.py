"""Stage 3 and a module's own backward hooks ([Note: module backward
hooks] in sharding/_backward_hooks.py): a full backward hook, a backward
pre-hook or an old-style backward hook that reads the module's weights
(its own or a child's) sees them gathered, as in torch, with every unit
released after use. Before, it read the (0,) placeholder: the mean of an
empty tensor is NaN, and every parameter was NaN after the step, with no
error. Compared with plain torch (SGD, fp32, 1e-6)."""
import pytest
import torch
from torch import nn

import zero

RELEASED = {"stage3_param_persistence_threshold": 0}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def __getitem__(self, i):  # block[0]: its Linear, as in a Sequential
        return self.inner

    def forward(self, x):
        return torch.tanh(self.inner(x))


def hooked_model(kind, units):
    """Linear, Tanh, two blocks (the repeated class: units="block" makes
    each a unit), a head; hooks registered as a user would, before
    initialize. A block's hook reads its child's weight: the block's unit
    holds it (with units="module" a block is no unit: a hook of its reads
    only what its own parameters' units hold, docs/stage3.md)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Block(), Block(), nn.Linear(8, 4))
    head, inner, block = model[4], model[2][0], model[3]
    if kind == "full":
        head.register_full_backward_hook(
            lambda mod, grad_in, grad_out: (grad_in[0] * mod.weight.abs().mean(),))
        inner.register_full_backward_hook(
            lambda mod, grad_in, grad_out: (grad_in[0] + 0.01 * mod.weight.sum(),))
        if units == "block":  # a block's hook reading its child's weight
            block.register_full_backward_hook(
                lambda mod, grad_in, grad_out: (grad_in[0] * (1 + mod[0].bias.abs().mean()),))
    elif kind == "pre":
        head.register_full_backward_pre_hook(
            lambda mod, grad_out: (grad_out[0] * mod.weight.abs().mean(),))
        if units == "block":
            block.register_full_backward_pre_hook(
                lambda mod, grad_out: (grad_out[0] * (1 + mod[0].weight.abs().mean()),))
    else:  # torch's old register_backward_hook (the grad_fn of the output)
        def old_style(mod, grad_in, grad_out):
            return tuple(None if g is None else g * mod.weight.abs().mean() for g in grad_in)
        head.register_backward_hook(old_style)
    return model


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(6, 8, generator=g) for _ in range(3)]


def torch_run(kind, units):
    model = hooked_model(kind, units)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return model.state_dict()


def zero_run(kind, units):
    model = hooked_model(kind, units)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, units=units, **RELEASED)
    losses = []
    for x in batches():
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    engine.close()
    return state, losses, model


def assert_matches(state, reference):
    for name, value in reference.items():
        assert torch.isfinite(state[name]).all(), name
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook")
@pytest.mark.parametrize("kind", ["full", "pre", "old"])
@pytest.mark.parametrize("units", ["block", "module"])
def test_backward_hooks_read_gathered_weights(kind, units):
    state, losses, model = zero_run(kind, units)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert_matches(state, torch_run(kind, units))
    # close() put the user's hooks back as they were: the model trains as torch's
    hooks = [h for m in model.modules()
             for h in list(m._backward_hooks.values()) + list(m._backward_pre_hooks.values())]
    assert hooks and all(not hasattr(h, "__wrapped__") for h in hooks)


def test_a_hook_removed_while_the_engine_runs_stays_removed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    calls = []
    handle = model[1].register_full_backward_hook(lambda *a: calls.append(1))
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    engine.backward(engine(torch.randn(2, 8)).sum())
    handle.remove()
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.close()
    assert calls == [1] and not model[1]._backward_hooks


def test_a_hook_on_the_whole_model_gathers_no_unit_below_it():
    """A gradient monitor on the root module: its hooks gather the root's
    own units (none here), not every unit below it, which held the whole
    model gathered at every backward."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(6)])
    seen = []
    model.register_full_backward_hook(lambda mod, grad_in, grad_out: seen.append(1))
    model.register_full_backward_pre_hook(lambda mod, grad_out: seen.append(2))
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_prefetch_bucket_size=1, **RELEASED)  # no prefetch
    unit = engine.groups[0].units[0].total
    for x in batches():
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert seen == [2, 1] * 3
    assert engine._schedule.peak_live <= unit  # the running unit alone
    engine.close()

"""Stage 3 on model shapes that read parameters in ways the per-module hooks
do not see coming, each against the same model trained by plain torch
(SGD, so that the comparison is exact up to summation order: 1e-6).

Every unit is released after use (persistence threshold 0), as in a model
too large to keep any of it gathered. The cases:
- a parameter used only on some steps, inside a module whose other
  parameter is used on every step (its unit is released once the others'
  gradients are in, before autograd reads the late one);
- an auxiliary loss of a module's weights computed in its forward (read by
  backward off the path through the module's outputs);
- outputs in plain dataclasses (pytree sees no tensors inside them);
- integer parameters (kept as they are, never cast nor partitioned);
- torch's MultiheadAttention, whose forward reads out_proj's weights
  without calling out_proj;
and, refused with a clear error, a backward with create_graph=True (which
stages 0-2 run as torch does).
See [Note: saved parameters] in python/zero/_stage3.py."""
import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero
from conftest import max_rel_error
from engine_cases import no_launcher

RELEASED = dict(stage3_param_persistence_threshold=0)
TOL = 1e-6


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


class SometimesScaled(nn.Module):
    """`scale` is read on odd steps only; `weight` on every step. `how`
    picks the op that reads `scale`: one that saves it for backward
    (mul, linear), or one that does not (add)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.scale = nn.Parameter(torch.rand(8) + 0.5)
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x, use_scale):
        if use_scale:
            if self.how == "mul":
                x = x * self.scale
            elif self.how == "linear":
                x = F.linear(x, torch.diag(self.scale))
            else:
                x = x + self.scale
        return x @ self.weight


class GatedNet(nn.Module):
    """A layer first, so that backward needs the gradients of inner's
    input, and with them the values of inner's parameters."""

    def __init__(self, how):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = SometimesScaled(how)
        self.head = nn.Linear(8, 3)

    def forward(self, x, use_scale):
        return self.head(torch.tanh(self.inner(self.pre(x), use_scale)))


class CheckpointedGatedNet(GatedNet):
    """GatedNet with `inner` under activation checkpointing: its saved
    tensors go through checkpoint's hooks, not stage 3's."""

    def __init__(self, how, reentrant):
        super().__init__(how)
        self.reentrant = reentrant

    def forward(self, x, use_scale):
        h = checkpoint(self.inner, self.pre(x), use_scale, use_reentrant=self.reentrant)
        return self.head(torch.tanh(h))


class WithAuxLoss(nn.Module):
    """Keeps a penalty of its own weight, computed in forward, for the loss
    (off the path from its output back to the weight)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.aux = None

    def forward(self, x):
        y = x @ self.weight
        self.aux = self.weight.pow(2).sum() * 1e-2
        return y


class AuxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.block = WithAuxLoss()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.block(self.pre(x)))).sum(-1) + self.block.aux


@dataclasses.dataclass
class Hidden:
    states: torch.Tensor
    note: str = "kept"


class DataclassBlock(nn.Module):
    """Its own weight (no child module whose output hooks would cover it)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return Hidden(torch.tanh(x @ self.weight))


class DataclassNet(nn.Module):
    """A child and the root both return dataclasses."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.block = DataclassBlock()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        hidden = self.block(self.pre(x))
        assert hidden.note == "kept"
        return Hidden(self.head(hidden.states))


class Codebook(nn.Module):
    """An integer parameter (frozen by necessity) used as indices."""

    def __init__(self):
        super().__init__()
        self.codes = nn.Parameter(torch.tensor([3, 1, 16777217 % 8, 2]), requires_grad=False)
        self.big = nn.Parameter(torch.tensor([16777217]), requires_grad=False)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)[:, self.codes] + (self.big - 16777216).float()


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.layer(x))


def pair(cls, *args):
    torch.manual_seed(0)
    model, ref = cls(*args), cls(*args)
    ref.load_state_dict(model.state_dict())
    return model, ref


def output_tensor(out):
    return out.states if isinstance(out, Hidden) else out


def train_both(cls, args, inputs, stage=3, **options):
    """Train an engine and the plain twin on the same inputs; returns the
    engine's full state dict, the reference and the engine."""
    model, ref = pair(cls, *args)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=stage, **options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for call in inputs:
        engine.backward(output_tensor(engine(*call)).square().mean())
        engine.step()
        opt.zero_grad()
        output_tensor(ref(*call)).square().mean().backward()
        opt.step()
    state = engine.full_state_dict()
    return state, ref, engine


def assert_matches(state, ref):
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=TOL, atol=TOL, msg=name)


def gated_inputs(steps=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=g), step % 2 == 1) for step in range(steps)]


@pytest.mark.parametrize("how", ["mul", "linear", "add"])
def test_parameter_used_again_after_an_unused_step(how):
    state, ref, engine = train_both(GatedNet, (how,), gated_inputs(), **RELEASED)
    assert_matches(state, ref)
    engine.close()


def test_auxiliary_loss_of_weights_computed_in_forward():
    g = torch.Generator().manual_seed(2)
    inputs = [(torch.randn(5, 8, generator=g),) for _ in range(3)]
    state, ref, engine = train_both(AuxNet, (), inputs, **RELEASED)
    assert_matches(state, ref)
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_dataclass_outputs(stage):
    g = torch.Generator().manual_seed(3)
    inputs = [(torch.randn(5, 8, generator=g),) for _ in range(3)]
    state, ref, engine = train_both(DataclassNet, (), inputs, stage=stage, **RELEASED)
    assert_matches(state, ref)
    engine.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_integer_parameters_are_kept_as_they_are(precision):
    model, ref = pair(Codebook)
    engine = zero.initialize(model, stage=3, precision=precision, **RELEASED)
    assert model.codes.dtype == torch.int64 and model.big.dtype == torch.int64
    assert torch.equal(model.big, torch.tensor([16777217]))  # not rounded through a float
    x = torch.randn(5, 8)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    state = engine.full_state_dict()
    assert torch.equal(state["codes"], ref.codes) and torch.equal(state["big"], ref.big)
    summary = engine.memory_summary()
    assert summary["frozen_params"] == model.codes.nbytes + model.big.nbytes
    estimate = zero.estimate_memory(Codebook(), 1, stage=3, precision=precision, **RELEASED)
    assert estimate["frozen_params"] == summary["frozen_params"]
    engine.close()


def test_multihead_attention_without_registration():
    g = torch.Generator().manual_seed(4)
    inputs = [(torch.randn(2, 5, 8, generator=g),) for _ in range(3)]
    state, ref, engine = train_both(Attention, (), inputs, **RELEASED)
    assert_matches(state, ref)
    engine.close()


def test_backward_with_create_graph_is_refused():
    model, _ref = pair(GatedNet, "mul")
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    x = torch.randn(5, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(engine(x, True).square().sum(), x, create_graph=True)
    engine.zero_grad()  # the refused backward is dropped; training goes on
    state, ref, second = train_both(GatedNet, ("mul",), gated_inputs(), **RELEASED)
    assert_matches(state, ref)
    second.close()
    engine.close()


@pytest.mark.parametrize("persistent", [True, False])
def test_parameter_changed_in_place_before_backward_is_caught(persistent):
    """With the saved-tensor hook, the hook keeps torch's version check (a
    persistent unit: its parameters are there to change). A released one
    is an empty placeholder: its change is refused when the backward
    gathers it again."""
    model, _ref = pair(GatedNet, "mul")
    options = {"stage3_param_persistence_threshold": 10**9} if persistent else RELEASED
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **options)
    loss = engine(torch.randn(5, 8), True).square().mean()
    with torch.no_grad():
        model.inner.scale.mul_(2)
    match = "modified by an inplace operation" if persistent else \
        "parameter 'inner.scale' was changed .* where stage 3 cannot keep the change"
    with pytest.raises(RuntimeError, match=match):
        engine.backward(loss)
    engine.zero_grad()
    engine.close()


@pytest.mark.parametrize("changed_by", ["step", "gathered block"])
def test_a_released_parameter_saved_itself_is_version_checked(changed_by):
    """x * scale saves the parameter itself, not a view of it (the saved
    tensor kept as the parameter, [Note: saved parameters]): a change made
    where stage 3 keeps it (the step; a GatheredParameters block with
    modifier_rank) between the forward and the backward is refused, as
    torch refuses it without stage 3."""
    model, _ref = pair(GatedNet, "mul")
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    engine.backward(engine(torch.randn(5, 8), True).square().mean())  # grads for the step
    loss = engine(torch.randn(5, 8), True).square().mean()
    if changed_by == "step":
        engine.step()
    else:
        with zero.GatheredParameters([model.inner.scale], modifier_rank=0):
            with torch.no_grad():
                model.inner.scale.mul_(2)
    # the step changes every parameter (the head's weight is read first)
    shape = "" if changed_by == "step" else ": a parameter of shape \\(8,\\)"
    with pytest.raises(RuntimeError, match="modified by an inplace operation" + shape):
        engine.backward(loss)
    engine.zero_grad()
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradient_penalty_below_stage_3(stage):
    """Stages 0-2 keep every parameter, so a double backward (the gradient
    of the input's gradient norm in the loss) runs as in torch."""
    def loss_of(net, x):
        x = x.clone().requires_grad_(True)
        out = net(x, True)
        (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out.square().mean() + ((grad_x.norm(dim=1) - 1) ** 2).mean()
    model, ref = pair(GatedNet, "mul")
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=stage)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, _use in gated_inputs(3):
        engine.backward(loss_of(engine, x))
        engine.step()
        opt.zero_grad()
        loss_of(ref, x).backward()
        opt.step()
    assert_matches(engine.full_state_dict(), ref)
    engine.close()


def test_state_dict_of_released_parameters_warns():
    """model.state_dict() holds the empty placeholders (a checkpoint saved
    from it lacks them): a warning, since PEFT filters the adapters out of
    the whole model's state_dict(). Inside GatheredParameters it is whole."""
    model, _ref = pair(GatedNet, "mul")
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    engine.backward(engine(torch.randn(5, 8), True).square().mean())
    engine.step()
    for owner in (model, engine, model.inner):  # a submodule too
        with pytest.warns(RuntimeWarning, match="state_dict\\(\\) holds empty placeholders"):
            owner.state_dict()
    full = engine.full_state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with zero.GatheredParameters(list(model.parameters())):
            # copies: the gathered storage is freed on exit
            state = {k: v.clone() for k, v in model.state_dict().items()}
        with zero.GatheredParameters(list(model.inner.parameters())):
            model.inner.state_dict()  # its own units gathered: no warning
    assert all(torch.equal(state[k], full[k]) for k in full)
    engine.close()
    kept = zero.initialize(GatedNet("mul"), stage=3)  # small units stay gathered
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(kept.module.state_dict()) == set(full)
    kept.close()


@pytest.mark.parametrize("reentrant", [False, True])
def test_parameter_used_again_under_activation_checkpointing(reentrant):
    state, ref, engine = train_both(CheckpointedGatedNet, ("mul", reentrant), gated_inputs(),
                                    **RELEASED)
    assert_matches(state, ref)
    engine.close()


class CountingLinear(nn.Linear):
    calls = 0

    def forward(self, x):
        CountingLinear.calls += 1
        return super().forward(x)


class CountedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = CountingLinear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.first(x)))


def test_hooks_around_the_engine_still_see_the_activations():
    """checkpoint(engine, x) pushes its hooks before stage 3 pushes its own:
    the activations must still reach checkpoint's (it recomputes the
    forward in backward), the parameters stay with stage 3."""
    model, ref = pair(CountedNet)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        x = torch.randn(5, 8, generator=g)
        CountingLinear.calls = 0
        out = checkpoint(engine, x, use_reentrant=False)
        engine.backward(out.square().mean())
        engine.step()
        assert CountingLinear.calls == 2  # the forward, and its recomputation
        opt.zero_grad()
        ref(x).square().mean().backward()
        opt.step()
    assert_matches(engine.full_state_dict(), ref)
    engine.close()


class Recursive(nn.Module):
    """The root calls itself (an inner pass of the same network)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, depth=1):
        h = torch.tanh(self.a(x))
        if depth:
            h = h + self(h, depth - 1)
        return self.b(h) * x.sum()


def test_root_that_calls_itself():
    g = torch.Generator().manual_seed(6)
    inputs = [(torch.randn(3, 8, generator=g),) for _ in range(3)]
    state, ref, engine = train_both(Recursive, (), inputs, **RELEASED)
    assert_matches(state, ref)
    engine.close()


class Interruptible(nn.Module):
    armed = None  # an exception class to raise inside the forward

    def forward(self, x):
        if Interruptible.armed is not None:
            raise Interruptible.armed()
        return x


class InterruptibleNet(GatedNet):
    def __init__(self, how):
        super().__init__(how)
        self.stop = Interruptible()

    def forward(self, x, use_scale):
        return self.head(torch.tanh(self.stop(self.inner(self.pre(x), use_scale))))


@pytest.mark.parametrize("where", ["pre-hook", "forward"])
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_forward_that_raised_leaves_the_schedule_whole(where, error):
    """A forward stopped by an exception (a user's pre-hook on the root, a
    check inside the model) or by KeyboardInterrupt (a notebook's stop
    button: torch then skips the post-forward hooks) must leave the next
    passes as they were: late reads still gathered, results as torch's."""
    model, ref = pair(InterruptibleNet, "mul")
    armed = {"on": False}

    def check(_module, _args):
        if armed["on"]:
            raise error()
    model.register_forward_pre_hook(check)  # before initialize: runs before stage 3's
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    if where == "pre-hook":
        armed["on"] = True
    else:
        Interruptible.armed = error
    try:
        with pytest.raises(error):
            engine(torch.randn(5, 8), True)
    finally:
        armed["on"], Interruptible.armed = False, None
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, use in gated_inputs():
        engine.backward(engine(x, use).square().mean())
        engine.step()
        assert engine._schedule.root_depth == 0 and engine._schedule._saving is None
        opt.zero_grad()
        ref(x, use).square().mean().backward()
        opt.step()
    assert_matches(engine.full_state_dict(), ref)
    engine.close()


def test_persistence_threshold_counts_the_parameters_elements():
    """Linear(10, 10) holds 110 elements, laid out padded to more: at a
    threshold of 110 its unit stays gathered (the padded total, which grows
    with the world size, used to decide), and the estimate agrees."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 300))
    options = dict(stage=3, stage3_param_persistence_threshold=110)
    estimate = zero.estimate_memory(model, 1, **options)
    engine = zero.initialize(model, **options)
    [small] = [u for fg in engine.groups for u in fg.units if u.numel == 110]
    assert small.total > 110 and small.persistent
    assert not any(u.persistent for fg in engine.groups for u in fg.units if u.numel > 110)
    assert engine.memory_summary()["persistent"] == estimate["persistent"] == small.total * 4
    engine.close()


class _HeldInContainers(nn.Module):
    """Weights in an nn.ParameterList and an nn.ParameterDict, read by the
    owner's forward: the containers' own forwards never run."""

    def __init__(self):
        super().__init__()
        self.rows = nn.ParameterList([nn.Parameter(torch.randn(6, 6)) for _ in range(2)])
        self.named = nn.ParameterDict({"shift": nn.Parameter(torch.randn(6))})
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        for w in self.rows:
            x = torch.tanh(x @ w + self.named["shift"])
        return self.out(x)


def test_parameters_in_parameter_lists_and_dicts_are_gathered():
    """Before, the containers' units were hooked on forwards that never run,
    so the owner read empty placeholders (a shape error in Reformer)."""
    torch.manual_seed(0)
    model = nn.Sequential(_HeldInContainers(), nn.Tanh(), nn.Linear(3, 2))
    ref = copy.deepcopy(model)
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=3, **RELEASED)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 6, generator=g)
        engine.backward(engine(x).square().mean())
        engine.step()
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
    full = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        assert max_rel_error(full[name], value) <= 1e-6, name
    engine.close()


class OldWeightNorm(nn.Module):
    """torch.nn.utils.weight_norm, the hook-based one: a forward pre-hook
    computes `weight` from the parameters weight_g and weight_v; and a
    pre-hook of the model's own that notes the head's weight shape."""

    def __init__(self):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # its deprecation
            self.layer = torch.nn.utils.weight_norm(nn.Linear(8, 8))
        self.head = nn.Linear(8, 8)
        self.seen = []
        self.head.register_forward_pre_hook(
            lambda m, args: self.seen.append(tuple(m.weight.shape)))

    def forward(self, x):
        return self.head(torch.tanh(self.layer(x)))


def test_the_models_own_pre_hooks_read_the_gathered_parameters():
    """Stage 3's gather is the first pre-hook of a module, before those the
    model had: the old weight_norm's computed its weight from the released
    placeholders (a SIGFPE in torch._weight_norm), a user's pre-hook saw
    shape (0,)."""
    g = torch.Generator().manual_seed(6)
    inputs = [(torch.randn(5, 8, generator=g),) for _ in range(3)]
    state, ref, engine = train_both(OldWeightNorm, (), inputs, units="module", **RELEASED)
    assert engine.module.seen == [(8, 8)] * 3
    assert_matches(state, ref)  # layer.weight_g, layer.weight_v, head
    engine.close()


class RenormedEmbedding(nn.Module):
    """nn.Embedding(max_norm=...): torch renormalizes the looked-up rows of
    the weight in place, inside the forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 8, max_norm=1.0)
        self.head = nn.Linear(8, 8)

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_an_embedding_that_renormalizes_in_forward_stays_gathered():
    """Its unit is kept gathered whatever its size (a release after the
    forward dropped the renormalized rows and the next gather refused the
    lost write), the write taken in at the step as plain torch keeps it;
    estimate_memory counts it persistent as the engine does."""
    from test_estimate import check
    g = torch.Generator().manual_seed(7)
    inputs = [(torch.randint(0, 40, (5, 3), generator=g),) for _ in range(3)]
    model = RenormedEmbedding()
    estimate = zero.estimate_memory(model, optimizer=torch.optim.SGD(model.parameters(),
                                                                     lr=0.1),
                                    stage=3, **RELEASED)
    state, ref, engine = train_both(RenormedEmbedding, (), inputs, **RELEASED)
    persistent = [u.persistent for fg in engine.all_groups for u in fg.units]
    assert persistent.count(True) == 1  # the embedding's unit alone
    assert_matches(state, ref)
    check(estimate, engine.memory_summary())
    engine.close()

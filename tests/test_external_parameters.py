"""deepspeed.zero.register_external_parameter (sharding/_external.py):
DeepSpeed's module-level call, made in a module's __init__ before any
engine exists, for a forward that reads another module's weight without
calling it. Stage 3 with every unit released then gathers it around that
forward and its backward; training equals plain torch (SGD, fp32). Without
the call, the read by attribute (`self.embed.weight`) inside the forward
finds it released, and the engine registers and gathers it then, as
DeepSpeed does ([Note: parameters read by attribute])."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero
import zero.deepspeed as deepspeed

RELEASED = {"stage3_param_persistence_threshold": 0}


class TiedHead(nn.Module):
    """Reads the embedding's weight itself (a tied output projection)."""
    def __init__(self, embed, register):
        super().__init__()
        self.embed = embed
        self.norm = nn.LayerNorm(8)
        if register:
            deepspeed.zero.register_external_parameter(self, embed.weight)

    def forward(self, h):
        return F.linear(self.norm(h), self.embed.weight)


class Net(nn.Module):
    def __init__(self, register=True):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.head = TiedHead(self.embed, register)

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.embed(ids))))


def released_twins(cls):
    """A model of `cls` under a stage-3 engine with every unit released,
    and its twin with torch's SGD."""
    torch.manual_seed(0)
    model = cls()
    reference = copy.deepcopy(model)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    return model, reference, torch.optim.SGD(reference.parameters(), lr=0.1), engine


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 16, (4, 5), generator=g) for _ in range(3)]


def train(model, step):
    for ids in batches():
        step(model(ids).float().logsumexp(-1).mean())


@pytest.mark.parametrize("when", ["in __init__", "after initialize", "never"])
def test_a_registered_external_parameter_trains_as_torch(when):
    torch.manual_seed(0)
    model = Net(register=when == "in __init__")
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def torch_step(loss):
        opt.zero_grad()
        loss.backward()
        opt.step()
    train(reference, torch_step)

    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    if when == "after initialize":
        deepspeed.zero.register_external_parameter(model.head, model.embed.weight)

    def zero_step(loss):
        engine.backward(loss)
        engine.step()
    train(engine, zero_step)
    state = engine.full_state_dict()
    engine.close()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("grad", [True, False])
def test_without_the_call_the_read_registers_it_on_the_running_module(grad):
    """The head's forward read the placeholder: torch's shape error
    ("size mismatch ... vec (0)"), under no_grad (an evaluation) too. The
    head holds no parameter of its own, so it has no hooks: the read is
    registered on the innermost hooked module running, the model itself."""
    torch.manual_seed(0)
    model = Net(register=False)
    reference = copy.deepcopy(model)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    schedule = engine._schedule
    assert model.head not in schedule.units_of and schedule.units_of[model] == []
    with torch.set_grad_enabled(grad):
        for ids in batches():
            torch.testing.assert_close(engine(ids), reference(ids))
    embed_unit = schedule.place[id(model.embed.weight)][1]
    assert [u for _fg, u in schedule.units_of[model]] == [embed_unit]
    assert not embed_unit.gathered
    engine.close()
    assert type(model.embed._parameters) is dict  # as it was


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        deepspeed.zero.register_external_parameter("head", nn.Parameter(torch.zeros(1)))
    with pytest.raises(TypeError, match="parameter must be a torch.nn.Parameter"):
        deepspeed.zero.register_external_parameter(nn.Linear(1, 1), torch.zeros(1))


class SharedHead(nn.Module):
    """Reads both parameters of another module's unit itself."""
    def __init__(self, shared):
        super().__init__()
        self.shared = [shared]  # not a child: its unit is not the head's own
        deepspeed.zero.register_external_parameter(self, shared.weight)
        deepspeed.zero.register_external_parameter(self, shared.bias)

    def forward(self, h):
        return F.linear(h, self.shared[0].weight, self.shared[0].bias)


class SharedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.shared = nn.Linear(8, 8)
        self.head = SharedHead(self.shared)

    def forward(self, ids):
        return self.head(torch.tanh(self.shared(self.embed(ids))))


def test_unregister_takes_the_gather_away_once_nothing_registered_needs_it():
    model, reference, opt, engine = released_twins(SharedNet)
    # the weight, still registered, keeps the unit both lie in
    deepspeed.zero.unregister_external_parameter(model.head, model.shared.bias)
    # a module's own parameter registered on it and unregistered: still its own
    deepspeed.zero.register_external_parameter(model.shared, model.shared.weight)
    deepspeed.zero.unregister_external_parameter(model.shared, model.shared.weight)
    for ids in batches():
        opt.zero_grad()
        reference(ids).logsumexp(-1).mean().backward()
        opt.step()
        engine.backward(engine(ids).logsumexp(-1).mean())
        engine.step()
    state = engine.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6, msg=name)
    deepspeed.zero.unregister_external_parameter(model.head, model.shared.weight)
    unit = engine._schedule.place[id(model.shared.weight)][1]
    assert all(u is not unit for _fg, u in engine._schedule.units_of[model.head])
    engine(batches()[0])  # the read by attribute finds it again
    assert any(u is unit for _fg, u in engine._schedule.units_of[model.head])
    engine.close()


def test_unregister_before_initialize_and_twice():
    torch.manual_seed(0)
    model = Net(register=True)
    deepspeed.zero.unregister_external_parameter(model.head, model.embed.weight)
    with pytest.raises(RuntimeError, match="not a registered external parameter of TiedHead"):
        deepspeed.zero.unregister_external_parameter(model.head, model.embed.weight)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    assert model.head not in engine._schedule.units_of  # as if never registered
    engine.close()
    with pytest.raises(TypeError, match="parameter must be a torch.nn.Parameter"):
        deepspeed.zero.unregister_external_parameter(model.head, torch.zeros(1))


def test_unregister_leaves_what_the_engine_found_itself_and_takes_the_engines_calls():
    """nn.MultiheadAttention's forward reads out_proj's weights: the engine
    gathers them around it on its own. A user's register and unregister
    of one of them leaves that as it was (the unregister took the gather
    away: a shape error at the next forward). A registration through the
    engine's own method is unregistered by deepspeed.zero's call too."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    reference = copy.deepcopy(attention)
    engine = zero.initialize(attention, optimizer=torch.optim.SGD(attention.parameters(),
                                                                  lr=0.1),
                             stage=3, **RELEASED)
    deepspeed.zero.register_external_parameter(attention, attention.out_proj.weight)
    deepspeed.zero.unregister_external_parameter(attention, attention.out_proj.weight)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(engine(x, x, x)[0], reference(x, x, x)[0])
    engine.close()

    model = SharedNet()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    probe = nn.Linear(8, 8)  # not in the model: still refused by name
    with pytest.raises(ValueError, match="not one the engine partitions"):
        engine.register_external_parameter(model.head, probe.weight)
    engine.register_external_parameter(model.embed, model.shared.weight)
    deepspeed.zero.unregister_external_parameter(model.embed, model.shared.weight)
    engine(batches()[0])  # the head's own registrations still stand
    engine.close()


def _root_walks_at_initialize(model, **options):
    """How many times initialize walks the whole model (root.modules())."""
    walks, real = [0], nn.Module.modules

    def counting(self):
        walks[0] += self is model
        return real(self)
    nn.Module.modules = counting
    try:
        engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 stage=3, **options)
    finally:
        nn.Module.modules = real
    engine.close()
    return walks[0]


def test_what_the_engine_finds_costs_no_walk_of_the_model_each():
    """The engine's own externals (each MultiheadAttention's out_proj, a
    ParameterList's entries for its owner) are checked against the model's
    modules kept from one walk, and against a module's list by id: a walk
    of the model per parameter, and a list scan per entry, made 800 layers
    take 7 s to initialize and a 40,000-entry ParameterList 20 s."""
    def layers(n):
        torch.manual_seed(0)
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), n,
                                     enable_nested_tensor=False)
    assert _root_walks_at_initialize(layers(10), units="module") == \
        _root_walks_at_initialize(layers(20), units="module")
    # and a ParameterList's entries still gather around their owner
    torch.manual_seed(0)

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.entries = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(500)])

        def forward(self, x):
            return x * torch.stack(list(self.entries)).sum()
    model, ref = Owner(), Owner()
    ref.load_state_dict(model.state_dict())
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3)
    x = torch.randn(4)
    assert torch.allclose(engine(x), ref(x))
    engine.close()
    # after initialize, a module taken out of the model is none of its
    # modules any more (the walk made for initialize is not kept)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3)
    taken_out = model[2]
    model[2] = nn.Identity()
    with pytest.raises(ValueError, match="Linear is not a module of the wrapped model"):
        deepspeed.zero.register_external_parameter(taken_out, model[0].weight)
    engine.close()


class PenalizedNet(nn.Module):
    """Adds a penalty on a child's weight to what it returns, reading the
    weight by attribute after the child ran (and released it)."""
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, ids):
        out = torch.tanh(self.fc(self.embed(ids))).logsumexp(-1).mean()
        return out + 0.1 * self.fc.weight.pow(2).sum()


def train_side_by_side(reference, opt, engine, run, loss_of=lambda out: out):
    """Each batch through torch's SGD and through the engine (called by
    `run`, the engine or a compiled one): the losses, then the final
    weights, as torch's."""
    for ids in batches():
        opt.zero_grad()
        expected = loss_of(reference(ids))
        expected.backward()
        opt.step()
        loss = loss_of(run(ids))
        torch.testing.assert_close(loss, expected)
        engine.backward(loss)
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6, msg=name)


def test_a_penalty_read_by_attribute_after_the_child_ran_trains_as_torch():
    """The penalty read the released placeholder: 0.0 (a sum over nothing),
    then torch's error in the backward ("PowBackward0 returned an invalid
    gradient")."""
    _model, reference, opt, engine = released_twins(PenalizedNet)
    train_side_by_side(reference, opt, engine, engine)


def test_a_read_by_attribute_is_found_under_torch_compile_too():
    _model, reference, opt, engine = released_twins(lambda: Net(register=False))
    train_side_by_side(reference, opt, engine, torch.compile(engine),
                       lambda out: out.float().logsumexp(-1).mean())


class PenalizedThroughParameters(PenalizedNet):
    """The penalty over self.parameters(): items, not reads by attribute."""
    penalty = True

    def forward(self, ids):
        out = torch.tanh(self.fc(self.embed(ids))).logsumexp(-1).mean()
        return out + 0.1 * sum(p.pow(2).sum() for p in self.parameters()) if self.penalty \
            else out


def test_a_released_parameter_used_through_parameters_is_named():
    """It computed with the placeholder: 0.0 for the penalty, then torch's
    "PowBackward0 returned an invalid gradient ... got [0]" in the
    backward. Refused by name as the forward saves it; training goes on."""
    model, reference, opt, engine = released_twins(PenalizedThroughParameters)
    with pytest.raises(RuntimeError, match="parameter 'embed.weight' was used in this forward "
                                           "while released .* not one through parameters"):
        engine(batches()[0])
    model.penalty = reference.penalty = False
    train_side_by_side(reference, opt, engine, engine)

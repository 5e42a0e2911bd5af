"""Stage 3 units whose root's forward never runs: containers (ModuleList,
ModuleDict) are never made roots, and a root that exists but is not
called (an nn.Sequential iterated) is refused by name on the first passes
([Note: roots never called] in sharding/_uncalled_roots.py). Before, both
ran the layers on released placeholders: torch's "mat2 must be a matrix"."""
import copy

import pytest
import torch
from torch import nn

import zero
from engine_cases import no_launcher


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


class NestedLists(nn.Module):
    """Stages of layers: a ModuleList of ModuleLists, iterated."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
                                    for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for stage in self.stages:
            for layer in stage:
                x = torch.relu(layer(x))
        return self.head(x)


class Heads(nn.Module):
    """Two ModuleDicts of layers (as PEFT's lora_A / lora_B)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.enc = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)})
        self.dec = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 2)})

    def forward(self, x):
        x = self.enc["b"](self.enc["a"](self.body(x)))
        return self.dec["b"](self.dec["a"](x))


class IteratedSequentials(NestedLists):
    """Blocks that are nn.Sequentials, iterated layer by layer (NestedLists'
    forward): the Sequentials repeat, so they are the blocks, but never
    called."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
                                    for _ in range(2))


def train_beside_torch(model, steps=3, **options):
    """Losses and final weights of zero stage 3 and of torch, same data."""
    ref = copy.deepcopy(model)
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=3, stage3_param_persistence_threshold=0, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(steps):
            x = torch.randn(4, 8, generator=g)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            ref_loss = ref(x).pow(2).mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
        full = engine.full_state_dict()
    finally:
        engine.close()
    for key, value in ref.state_dict().items():
        assert torch.allclose(full[key], value, atol=1e-6), key


@pytest.mark.parametrize("make", [NestedLists, Heads])
def test_containers_are_never_the_blocks(make):
    torch.manual_seed(0)
    model = make()
    assert zero.sharding._unit_roots.block_classes(model) == ("Linear",)
    train_beside_torch(model)


@pytest.mark.parametrize("option", ["units", "stage3_leaf_modules"])
def test_a_container_named_as_a_root_is_refused(option):
    torch.manual_seed(0)
    model = NestedLists()
    with pytest.raises(ValueError, match=f"{option}: ModuleList modules are containers whose "
                                         "forward never runs"):
        zero.initialize(model, stage=3, **{option: [nn.ModuleList]})
    assert all(p.numel() > 0 for p in model.parameters())


def test_a_block_iterated_instead_of_called_is_refused_by_name():
    torch.manual_seed(0)
    model = IteratedSequentials()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             stage3_param_persistence_threshold=0)
    with pytest.raises(RuntimeError, match=r"module 'stages.0.0' \(Linear\) runs while its "
                                           r"parameters are released.*'stages.0' \(Sequential\)"
                                           ".*units='module'"):
        engine(torch.randn(4, 8))
    engine.close()


def test_the_remedy_the_refusal_names_trains_as_torch():
    torch.manual_seed(0)
    train_beside_torch(IteratedSequentials(), units="module")


class CalledBlocks(nn.Module):
    """Blocks (nn.Sequentials) called as they should be."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def watched_engine():
    torch.manual_seed(0)
    model = CalledBlocks()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             stage3_param_persistence_threshold=0)
    assert zero.sharding._unit_roots.block_classes(model) == ("Sequential",)
    return model, engine, model.blocks[0][0]


def test_the_watch_stands_aside_after_two_backwards():
    """The per-module hooks cost what units by block save: gone once the
    second backward ends. An inner call on gathered parameters passes."""
    model, engine, inner = watched_engine()
    assert len(inner._forward_pre_hooks) == 1
    with zero.GatheredParameters(list(model.parameters())):
        inner(torch.randn(4, 8))
    for step in range(3):
        engine.backward(engine(torch.randn(4, 8)).sum())
        engine.step()
        assert len(inner._forward_pre_hooks) == (1 if step < 1 else 0), step
    engine.close()


def test_the_watch_stands_aside_after_forwards_without_backward():
    """Evaluation or generation alone (no backward) ends the watch too."""
    from zero.sharding._uncalled_roots import WATCHED_FORWARDS
    model, engine, inner = watched_engine()
    with torch.no_grad():
        for _ in range(WATCHED_FORWARDS):
            engine(torch.randn(4, 8))
        assert len(inner._forward_pre_hooks) == 1
        engine(torch.randn(4, 8))
    assert len(inner._forward_pre_hooks) == 0
    engine.close()


def test_the_watch_adds_no_graph_break_under_compile(monkeypatch):
    """Run outside the graph as the engine's own hooks are, the watch split
    a compiled forward at every inner module, and the breaks stayed after
    the hooks went: compiled, it stands aside."""
    import zero.sharding._stage3 as stage3

    def graphs_of_first_step():
        graphs = []

        def backend(gm, _inputs):
            graphs.append(gm)
            return gm.forward
        torch._dynamo.reset()
        _model, engine, _inner = watched_engine()
        engine.module = torch.compile(engine.module, backend=backend)
        engine.backward(engine(torch.randn(4, 8)).sum())
        engine.step()
        engine.close()
        return len(graphs)
    watched = graphs_of_first_step()
    monkeypatch.setattr(stage3, "watch_uncalled_roots", lambda *_args: [])
    assert watched == graphs_of_first_step()


def test_a_copy_made_while_watched_runs_on_its_own():
    """A deepcopy or pickle of the model in the first passes (an EMA copy,
    a torch.save) takes no watch: a copy's hook held the engine's units
    and refused to run once they were released."""
    import io
    model, engine, _inner = watched_engine()
    with zero.GatheredParameters(list(model.parameters())):
        ema = copy.deepcopy(model)
        saved = io.BytesIO()
        torch.save(model, saved)
    x = torch.randn(2, 8)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert torch.equal(ema(x), loaded(x))
    engine.close()


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


class _LeafCalledInside(nn.Module):
    """A parent that calls the layers inside its leaf module, not the leaf."""

    def __init__(self):
        super().__init__()
        self.moe, self.head = _Expert(), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.moe.b(self.moe.a(x)))


@pytest.mark.parametrize("units", ["block", "module"])
def test_a_leaf_module_called_inside_names_its_own_remedy(units):
    """A stage3_leaf_modules root stays a root whatever `units` says, so
    the refusal names the leaf, not units='module' (which a user who had
    passed it was told again)."""
    torch.manual_seed(0)
    model = _LeafCalledInside()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0,
                             stage3_leaf_modules=[_Expert], units=units)
    with pytest.raises(RuntimeError, match="'moe' is a stage3_leaf_modules module") as caught:
        engine(torch.randn(2, 8))
    assert "units='module'" not in str(caught.value)
    engine.close()


def test_a_leaf_container_names_deepspeeds_call():
    """A ModuleList marked by deepspeed.utils.set_z3_leaf_modules is refused
    under the call's name, not stage3_leaf_modules, which was not set."""
    torch.manual_seed(0)
    model = NestedLists()
    model.stages[0]._z3_leaf = True
    with pytest.raises(ValueError, match="deepspeed.utils.set_z3_leaf_modules: ModuleList "
                                         "modules are containers"):
        zero.initialize(model, stage=3)

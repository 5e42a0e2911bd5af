"""What stage 3 gathers as one unit ([Note: units by block] in
sharding/_unit_roots.py): the model's repeated blocks by default, each
module's own parameters with units="module", or the roots named by
classes or a callable. Every choice trains the same numbers (stage 3 at
any unit size gathers the same values); the choice changes the hooks,
the units and the memory estimate, which must agree with the run."""
import pytest
import torch
import transformers
from torch import nn

import zero
from engine_cases import batches, loss_of, no_launcher


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Tower(nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 50)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def train(units, steps=3, **options):
    torch.manual_seed(0)
    model = Tower()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=3, stage3_param_persistence_threshold=0, units=units,
                             gradient_clipping=0.5, **options)
    for tokens, targets in batches("cpu", steps):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    return engine


def hooked_names(engine):
    names = {id(m): n for n, m in engine.module.named_modules()}
    return [names[id(m)] for m in engine._schedule.modules]


def test_blocks_are_the_default_units():
    engine = train("block")
    assert hooked_names(engine) == ["", "embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    # one unit a block, holding all of its parameters
    units = engine.groups[0].units
    assert [len(u.params) for u in units] == [1, 6, 6, 6, 2]
    engine.close()


@pytest.mark.parametrize("units", ["module", ("Block",), (Block,),
                                   lambda m: isinstance(m, Block)])
def test_every_choice_trains_the_same_numbers(units):
    expected = train("block").full_state_dict()
    engine = train(units)
    if units == "module":
        assert len(hooked_names(engine)) == 1 + 1 + 3 * 3 + 1  # each module holding parameters
    else:
        assert "blocks.1" in hooked_names(engine)
    got = engine.full_state_dict()
    engine.close()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_the_estimate_lays_out_the_same_units():
    for units in ("block", "module"):
        engine = train(units, steps=1)
        summary = engine.memory_summary()
        engine.close()
        torch.manual_seed(0)
        estimate = zero.estimate_memory(Tower(), stage=3, stage3_param_persistence_threshold=0,
                                        units=units, gradient_clipping=0.5)
        for key in ("params", "grads", "optimizer_states", "persistent"):
            assert estimate[key] == summary[key], (units, key)


def test_the_persistence_threshold_counts_a_whole_block():
    """A block under the threshold stays gathered for good, as a small
    module does with units="module"."""
    block = sum(p.numel() for p in Tower().blocks[0].parameters())
    torch.manual_seed(0)
    model = Tower()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             stage3_param_persistence_threshold=block)
    persistent = [u for u in engine.groups[0].units if u.persistent]
    assert len(persistent) >= 3 and all(u.numel <= block for u in persistent)
    engine.close()


def test_a_huggingface_model_names_its_blocks():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    assert model._no_split_modules == ["LlamaDecoderLayer"]
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3)
    names = hooked_names(engine)
    assert "model.layers.0" in names and "model.layers.1" in names
    assert not any(n.startswith("model.layers.0.") for n in names)  # nothing inside a block
    engine.close()


def test_a_model_without_repeats_gets_a_unit_per_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16))
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             stage3_param_persistence_threshold=0)
    assert hooked_names(engine) == ["", "0", "2"]
    engine.close()


@pytest.mark.parametrize("bad,match", [
    ("blocks", "units must be 'block', 'module'"),
    ((), "units must be"),
    ((3,), "units must be"),
    (("Blok",), "units: no module of the model is a 'Blok'"),
])
def test_bad_units_name_the_setting(bad, match):
    torch.manual_seed(0)
    model = Tower()
    with pytest.raises(ValueError, match=match):
        zero.initialize(model, stage=3, units=bad)
    assert all(p.numel() > 0 for p in model.parameters())


class _TanhBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x):
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("blocks_live", [1, 2, 3])
def test_prefetch_keeps_every_gathered_unit_within_max_live(blocks_live):
    """stage3_max_live_parameters bounds all gathered units, the running
    module's included: prefetch counted only what was gathered already, so
    the unit about to be gathered on demand went over (limit + a unit)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_TanhBlock() for _ in range(6)])
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0,
                             stage3_max_live_parameters=1)  # measured below
    unit = engine.groups[0].units[0].total
    assert len(engine.groups[0].units) == 6
    engine.close()
    limit = blocks_live * unit + unit // 2
    model = nn.Sequential(*[_TanhBlock() for _ in range(6)])
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0,
                             stage3_max_live_parameters=limit)
    prefetched = 0
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 32)).square().mean())
        prefetched += engine._schedule.counts["prefetched"]
        engine.step()
    assert engine._schedule.peak_live <= limit
    assert engine.memory_summary()["gathered_peak"] <= limit * 4  # fp32
    if blocks_live > 1:  # room ahead of the running unit: prefetch still runs
        assert prefetched > 0
    engine.close()

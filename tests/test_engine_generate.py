"""engine.generate ([Note: generation] in engine/_generation.py): a
stage-3 model's parameters gathered once for a whole generation, the
schedule's hooks set aside, no collective in between.

Checked against a plain copy of the model: greedy tokens equal its
generate's; no unit is gathered per token (the gather counts); training
after a generation equals training without one, bit for bit (train,
generate, train = train, train); the hooks are back afterwards. Two ranks
stopping at different lengths: tests/distributed/test_generation.py."""
import copy

import pytest
import torch

import zero
from engine_cases import Net, batches, engine_run, loss_of, no_launcher

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def tiny_gpt2():
    # no dropout: a generation in train mode would draw from the random
    # state the training's dropout draws from next
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64,
                                  n_positions=64, eos_token_id=None, bos_token_id=None,
                                  pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def train_steps(engine, seed, steps=2):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(1, 64, (2, 12), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_greedy_tokens_equal_the_plain_models(stage):
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                             stage=stage, stage3_param_persistence_threshold=0)
    prompt = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    if engine._schedule is not None:
        engine._schedule.take_counts()
    out = engine.generate(prompt, max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        expected = plain.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, expected)
    if engine._schedule is not None:
        # each unit gathered once for the whole generation, never per token
        units = sum(len(fg.units) for fg in engine.all_groups)
        assert engine._schedule.take_counts() == {"prefetched": 0, "on_demand": units}
        assert not engine._schedule.suspended
        assert all(not u.gathered for fg in engine.all_groups for u in fg.units)
    engine.close()


@pytest.mark.parametrize("delayed", [False, True], ids=["direct", "delayed update"])
def test_training_after_a_generation_is_unchanged(delayed, tmp_path):
    """With offload_optimizer.delayed_update an update is in flight at the
    generation: the whole gather must not land it (that put it a step early
    for the training after), and both gathers see the same parameters."""
    offload = {"device": "nvme", "nvme_path": str(tmp_path), "delayed_update": True} \
        if delayed else None
    results = []
    for with_generation in (False, True):
        model = tiny_gpt2().train()
        engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(),
                                                                    lr=1e-2),
                                 stage=3, stage3_param_persistence_threshold=0,
                                 offload_optimizer=offload)
        train_steps(engine, seed=3)
        if with_generation:
            prompt = torch.randint(1, 64, (1, 4), generator=torch.Generator().manual_seed(2))
            whole = engine.generate(prompt, max_new_tokens=6, do_sample=False,
                                    gather="whole", output_scores=True,
                                    return_dict_in_generate=True)
            units = engine.generate(prompt, max_new_tokens=6, do_sample=False,
                                    gather="units", output_scores=True,
                                    return_dict_in_generate=True)
            assert torch.equal(whole.sequences, units.sequences)
            for a, b in zip(whole.scores, units.scores):
                assert torch.equal(a, b)
        train_steps(engine, seed=4)
        results.append(engine.full_state_dict())
        engine.close()
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


def test_a_generate_function_for_other_models():
    torch.manual_seed(0)
    model = Net()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             stage3_param_persistence_threshold=0)
    engine_run(engine, batches("cpu", 1))

    def greedy(m, tokens, steps):
        for _ in range(steps):
            tokens = torch.cat([tokens, m(tokens)[:, -1:].argmax(-1)], dim=1)
        return tokens
    out = engine.generate(torch.tensor([[1, 2]]), 5, generate_fn=greedy)
    with zero.GatheredParameters(list(model.parameters())):
        plain = copy.deepcopy(model)
    expected = greedy(plain, torch.tensor([[1, 2]]), 5)
    assert torch.equal(out, expected)
    with pytest.raises(TypeError, match="Net has no generate method"):
        engine.generate(torch.tensor([[1]]))
    tokens, targets = batches("cpu", 1)[0]  # the hooks are back: training goes on
    engine.backward(loss_of(engine(tokens), targets))
    engine.step()
    engine.close()


@pytest.mark.parametrize("gather", ["units", "auto with little memory"])
def test_a_model_that_does_not_fit_generates_unit_by_unit(monkeypatch, gather):
    """gather="units", or "auto" when the whole model would take more than
    half the free memory: each forward gathers the units through the
    hooks (with prefetch), so the gathers grow with the tokens; the
    tokens are the plain model's."""
    from zero.engine import _generation
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                             stage=3, stage3_param_persistence_threshold=0)
    prompt = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    if gather == "units":
        kwargs = {"gather": "units"}
    else:
        needed = sum(p.numel() * 4 for p in plain.parameters())
        monkeypatch.setattr(_generation, "available_memory", lambda device: 2 * needed - 1)
        assert not _generation.whole_fits(engine)
        kwargs = {}
    engine._schedule.take_counts()
    out = engine.generate(prompt, max_new_tokens=12, do_sample=False, **kwargs)
    with torch.no_grad():
        assert torch.equal(out, plain.generate(prompt, max_new_tokens=12, do_sample=False))
    counts = engine._schedule.take_counts()
    units = sum(len(fg.units) for fg in engine.all_groups)
    assert counts["prefetched"] + counts["on_demand"] >= 12 * units  # every token's forward
    assert counts["prefetched"] > 0
    with pytest.raises(ValueError, match="gather='all'"):
        engine.generate(prompt, max_new_tokens=1, gather="all")
    engine.close()


def test_the_whole_model_is_gathered_when_it_fits(monkeypatch):
    from zero.engine import _generation
    model = tiny_gpt2()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                             stage=3, stage3_param_persistence_threshold=0)
    needed = sum(fg.numel for fg in engine.all_groups) * 4  # the whole model, fp32
    monkeypatch.setattr(_generation, "available_memory", lambda device: 2 * needed)
    engine._schedule.take_counts()
    engine.generate(torch.randint(1, 64, (1, 4)), max_new_tokens=6, do_sample=False)
    units = sum(len(fg.units) for fg in engine.all_groups)
    assert engine._schedule.take_counts() == {"prefetched": 0, "on_demand": units}
    engine.close()

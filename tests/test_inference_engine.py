"""zero.inference: an engine over a frozen model (no optimizer, no
gradient memory) whose outputs and greedy generations equal the plain
model's at stages 0 and 3, with the stage-3 shards in memory or streamed
from files (offload_param "nvme", ZeRO-Inference on the CPU); training
calls are refused, and a fully frozen model given to zero.initialize is
pointed at zero.inference."""
import pytest
import torch
from torch import nn

import zero
from engine_cases import no_launcher

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    no_launcher(monkeypatch)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=32, n_embd=32, n_layer=3, n_head=4, n_positions=16,
                     eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("stage, offload", [(0, None), (3, None), (3, "nvme")])
def test_inference_equals_the_plain_model(tmp_path, stage, offload):
    plain = tiny_gpt2()
    model = tiny_gpt2()
    options = {"offload_param": {"device": offload, "nvme_path": str(tmp_path)}} \
        if offload else {}
    engine = zero.inference(model, stage=stage, stage3_param_persistence_threshold=0,
                            **options)
    assert not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(1, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(engine(input_ids=ids).logits, plain(input_ids=ids).logits)
    tokens = engine.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(tokens, plain.generate(ids, max_new_tokens=5, do_sample=False))
    memory = engine.memory_summary()
    assert memory["grads"] == 0 and memory["optimizer_states"] == 0
    if stage == 3 and offload is None:  # the shards are what it holds
        assert memory["frozen_params"] >= sum(p.numel() * 4 for p in plain.parameters())
    for call in (engine.step, lambda: engine.clip_grad_norm_(1.0),
                 lambda: engine.backward(torch.zeros((), requires_grad=True))):
        with pytest.raises(RuntimeError, match="made by zero.inference"):
            call()
    engine.close()


def test_a_refused_inference_leaves_the_model_trainable():
    """Before, the parameters stayed frozen after the refusal, and a later
    zero.initialize (or a plain torch loop) trained nothing."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    with pytest.raises(ValueError):
        zero.inference(model, stage=5)
    assert [p.requires_grad for p in model.parameters()] == [True, True, True, False]
    zero.initialize(model, stage=1).close()


@pytest.mark.parametrize("stage", [0, 3])
def test_close_gives_each_parameters_requires_grad_back(stage):
    """The model is frozen while the engine runs; close() gives it back as
    it came (it stayed frozen, and a later training loop trained nothing)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    engine = zero.inference(model, stage=stage)
    assert not any(p.requires_grad for p in model.parameters())
    engine.close()
    assert [p.requires_grad for p in model.parameters()] == [True, True, True, False]


def test_a_frozen_model_for_initialize_is_pointed_at_inference():
    model = tiny_gpt2().requires_grad_(False)
    with pytest.raises(ValueError, match="use zero.inference"):
        zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_training_settings_are_refused_by_name():
    """They were taken and ignored (optimizer= raised "got multiple
    values")."""
    model = nn.Linear(4, 2)
    for setting, value in (("gradient_clipping", 1.0), ("optimizer", None),
                           ("lr_scheduler", None), ("offload_optimizer", {"device": "cpu"})):
        with pytest.raises(ValueError, match=f"zero.inference trains nothing: {setting} would"):
            zero.inference(model, **{setting: value})
    assert all(p.requires_grad for p in model.parameters())

"""zero.rlhf: its estimators against independent formulas, and
examples/rlhf/train.py (DeepSpeed-Chat's three steps on a synthetic task
whose preference is known: responses holding the target token are
better) in one process at stage 2 and on 2 ranks at stage 3: the reward
model orders new pairs right (accuracy >= 0.9; measured 1.0), and PPO
raises the true reward of the actor's samples (measured 0.25-0.31 in the
first iterations to 0.94-1.0 in the last) and the reward model's score."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from engine_cases import no_launcher
from zero.rlhf import gae, pairwise_loss, policy_loss, response_labels, token_logprobs, value_loss

pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rlhf" / "train.py"


def test_gae_is_the_discounted_sum_of_td_errors():
    """A_t = sum_l (gamma lam)^l delta_{t+l}, written out, with a response
    that ends early (its mask 0 after)."""
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    gamma, lam = 0.9, 0.8
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    for row in range(3):
        n = int(mask[row].sum())
        v = [float(values[row, t]) for t in range(n)] + [0.0]
        deltas = [float(rewards[row, t]) + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            expected = sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t))
            assert abs(float(advantages[row, t]) - expected) < 1e-5
            assert abs(float(returns[row, t]) - (expected + v[t])) < 1e-5
        assert not advantages[row, n:].any()


def test_the_losses_are_their_formulas():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    expected = -(torch.log(torch.sigmoid(torch.tensor(1.0))) +
                 torch.log(torch.sigmoid(torch.tensor(-1.0)))) / 2
    assert torch.allclose(pairwise_loss(chosen, rejected), expected)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    # a ratio of e^0.5 with a positive advantage is clipped at 1.2
    assert torch.allclose(policy_loss(torch.full((1, 2), 0.5), old, torch.ones(1, 2), mask, 0.2),
                          torch.tensor(-1.2))
    # ... and with a negative one it is not (the pessimistic side)
    assert torch.allclose(policy_loss(torch.full((1, 2), 0.5), old, -torch.ones(1, 2), mask,
                                      0.2), torch.exp(torch.tensor(0.5)))
    # the value moved 1.0 from 0.0 with the return at 2.0: the clipped one (0.2) is farther
    assert torch.allclose(value_loss(torch.ones(1, 2), old, torch.full((1, 2), 2.0), mask, 0.2),
                          torch.tensor(0.5 * 1.8 ** 2))


def test_token_logprobs_are_the_models_own_loss():
    """The mean of -log p over the response equals HuggingFace's loss with
    the prompt's labels ignored (response_labels)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=32, n_layer=1, n_head=2,
                                       n_positions=8)).eval()
    ids = torch.randint(0, 16, (3, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(input_ids=ids, labels=response_labels(ids, 5))
    logprobs = token_logprobs(out.logits, ids, 5)
    assert logprobs.shape == (3, 3)
    assert torch.allclose(-logprobs.mean(), out.loss, atol=1e-6)


def check_learned(result):
    """The reward model orders new pairs right, and PPO raises the true
    reward (the mean of the last 5 iterations against the first 5) and the
    reward model's score."""
    assert result["rm_accuracy"] >= 0.9
    curve = result["ppo"]

    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows)
    first, last = mean("true_reward", curve[:5]), mean("true_reward", curve[-5:])
    assert last >= first + 0.3, (first, last)
    assert mean("score", curve[-5:]) > mean("score", curve[:5]) + 2.0


def load_example(name):
    """examples/rlhf/train.py as a module of its own."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_the_three_steps_in_one_process(monkeypatch, tmp_path):
    no_launcher(monkeypatch)
    out = tmp_path / "curves.json"
    load_example("rlhf_example").main(["--stage", "2", "--json", str(out)])
    check_learned(json.loads(out.read_text()))


def test_the_three_steps_on_two_ranks(tmp_path):
    out = tmp_path / "curves.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(EXAMPLE), "--stage", "3", "--json",
                           str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    check_learned(json.loads(out.read_text()))


def test_ema_averages_the_actors_weights(monkeypatch):
    """PPOSettings(ema=d): after each iteration ema = d ema + (1 - d) weights,
    starting from the weights before PPO's first update (DeepSpeed-Chat's
    EMA copy of the actor starts there)."""
    import zero
    from zero.rlhf import PPOSettings, PPOTrainer, ScalarHeadModel
    no_launcher(monkeypatch)
    example = load_example("rlhf_example_ema")
    torch.manual_seed(0)
    actor_model, rm_model = example.tiny_gpt2(), ScalarHeadModel.from_causal_lm(
        example.tiny_gpt2())
    critic_model = ScalarHeadModel.from_causal_lm(example.tiny_gpt2())
    reference = zero.inference(example.tiny_gpt2(), stage=3)
    reward = zero.inference(rm_model, stage=3)
    actor = zero.initialize(actor_model, optimizer=torch.optim.SGD(actor_model.parameters(),
                                                                   lr=0.1), stage=3)
    critic = zero.initialize(critic_model, optimizer=torch.optim.SGD(
        critic_model.parameters(), lr=0.1), stage=3)
    ppo = PPOTrainer(actor, critic, reference, reward,
                     PPOSettings(response_length=example.RESPONSE, ema=0.75))
    prompts = example.Task(seed=3).prompts(8)
    before = actor.full_state_dict()
    ppo.step(prompts)
    first = actor.full_state_dict()
    expected = {k: 0.75 * v + 0.25 * first[k] for k, v in before.items()}
    for key, value in expected.items():
        assert torch.allclose(ppo.ema_state[key], value, atol=1e-7), key
    ppo.step(prompts)
    second = actor.full_state_dict()
    moved = 0.0
    for key, value in second.items():
        assert torch.allclose(ppo.ema_state[key], 0.75 * expected[key] + 0.25 * value,
                              atol=1e-7), key
        moved += float((value - first[key]).abs().sum())
    assert moved > 0  # the actor trained in between
    for engine in (actor, critic, reference, reward):
        engine.close()


def test_experience_is_made_without_dropout(monkeypatch):
    """Generation and scoring run with all four models in eval mode (as
    DeepSpeed-Chat's generate_experience): with dropout in the models, an
    actor equal to its reference has a KL of exactly 0 and a sequence
    scores the same twice; the actor and critic train in train mode again
    after, and zero.inference's engines stay in eval mode."""
    import copy

    import transformers

    import zero
    from zero.rlhf import PPOSettings, PPOTrainer, ScalarHeadModel
    no_launcher(monkeypatch)
    example = load_example("rlhf_example_dropout")

    def with_dropout():
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=example.VOCAB, n_embd=32, n_layer=2, n_head=4,
            n_positions=example.PROMPT + example.RESPONSE, resid_pdrop=0.3, embd_pdrop=0.3,
            attn_pdrop=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=example.PAD))
    torch.manual_seed(0)
    actor_model = with_dropout()
    reference = zero.inference(copy.deepcopy(actor_model), stage=3)
    reward = zero.inference(ScalarHeadModel.from_causal_lm(with_dropout()), stage=3)
    critic_model = ScalarHeadModel.from_causal_lm(with_dropout())
    actor = zero.initialize(actor_model, optimizer=torch.optim.SGD(actor_model.parameters(),
                                                                   lr=0.1), stage=3)
    critic = zero.initialize(critic_model, optimizer=torch.optim.SGD(
        critic_model.parameters(), lr=0.1), stage=3)
    assert not reference.training and not reward.module.training
    ppo = PPOTrainer(actor, critic, reference, reward,
                     PPOSettings(response_length=example.RESPONSE))
    prompts = example.Task(seed=3).prompts(4)
    experience = ppo.make_experience(prompts)
    assert experience["kl"] == 0.0
    with torch.no_grad():
        again = reward(experience["sequences"], attention_mask=experience["attention_mask"])
        once_more = reward(experience["sequences"], attention_mask=experience["attention_mask"])
    assert torch.equal(again, once_more)
    assert actor.training and actor.module.training and critic.module.training
    assert not reference.training
    for engine in (actor, critic, reference, reward):
        engine.close()


def test_a_scalar_head_on_a_peft_model_takes_its_transformer():
    """ScalarHeadModel.from_causal_lm(a PEFT LoRA model): PEFT's base_model
    is the whole LM (head and all), so the transformer inside is taken,
    its adapters with it: hidden states in, one number per token out."""
    peft = pytest.importorskip("peft")
    import transformers

    from zero.rlhf import ScalarHeadModel
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=16))
    lora = peft.get_peft_model(lm, peft.LoraConfig(r=4, target_modules=["c_attn"],
                                                   fan_in_fan_out=True))
    rm = ScalarHeadModel.from_causal_lm(lora).eval()
    assert rm.backbone is lm.transformer
    assert any("lora_" in name for name, _ in rm.named_parameters())
    ids = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        hidden = lm.transformer(input_ids=ids)[0]
        assert torch.equal(rm(ids), rm.head(hidden).squeeze(-1).float())


@pytest.mark.parametrize("setting, value", [
    ("gamma", float("nan")), ("lam", "0.95"), ("kl_coef", None), ("kl_coef", -1.0),
    ("clip_reward", -5.0), ("clip_policy", -0.2), ("clip_value", 0), ("temperature", 0.0),
    ("ppo_epochs", 0), ("ppo_epochs", 1.5), ("response_length", "4"), ("ema", 1.5),
    ("whiten_advantages", "yes")])
def test_ppo_settings_are_checked_by_name(setting, value):
    """Before: a NaN gamma made the actor's weights NaN, a negative
    clip_reward clamped every score to it, ppo_epochs 0 divided by zero
    after a whole generation and scoring."""
    from zero.rlhf import PPOSettings
    with pytest.raises(ValueError, match=f"PPOSettings.{setting} must be"):
        PPOSettings(**{"response_length": 2, setting: value})


def test_a_left_padded_prompt_scores_as_it_does_alone(monkeypatch):
    """With a left-padded prompt (its attention mask 0 on the pads) the
    actor's and reference's log-probabilities, the critic's values and the
    reward model's score of a row are those of the row without its pads,
    as HuggingFace's generate sampled it (it counts positions over the
    mask): scored at other positions, a padded row's log-probabilities were
    0.3 nats off, and the policy ratio was not the sampling policy's."""
    import copy

    import zero
    from zero.rlhf import PPOSettings, PPOTrainer, ScalarHeadModel
    no_launcher(monkeypatch)
    example = load_example("rlhf_example_padding")
    torch.manual_seed(0)
    actor_model = example.tiny_gpt2()
    reference = zero.inference(copy.deepcopy(actor_model), stage=3)
    reward = zero.inference(ScalarHeadModel.from_causal_lm(example.tiny_gpt2()), stage=3)
    critic_model = ScalarHeadModel.from_causal_lm(example.tiny_gpt2())
    actor = zero.initialize(actor_model, optimizer=torch.optim.SGD(actor_model.parameters(),
                                                                   lr=0.1), stage=3)
    critic = zero.initialize(critic_model, optimizer=torch.optim.SGD(
        critic_model.parameters(), lr=0.1), stage=3)
    ppo = PPOTrainer(actor, critic, reference, reward,
                     PPOSettings(response_length=example.RESPONSE), pad_token_id=example.PAD)
    prompts = example.Task(seed=3).prompts(2)
    padded = prompts.clone()
    padded[0, :2] = example.PAD  # row 0: a prompt two tokens shorter, padded on the left
    mask = torch.ones_like(padded)
    mask[0, :2] = 0
    torch.manual_seed(1)
    both = ppo.make_experience(padded, mask)
    alone_prompt = both["sequences"][:1, 2:example.PROMPT]
    response = both["sequences"][:1, example.PROMPT:]
    # row 0 again without its pads, scored on the same response
    monkeypatch.setattr(ppo, "generate", lambda prompts, attention_mask=None: (
        torch.cat([alone_prompt, response], 1), torch.ones(1, alone_prompt.shape[1] +
                                                           response.shape[1], dtype=torch.long)))
    alone = ppo.make_experience(alone_prompt)
    for key in ("logprobs", "values", "scores"):
        assert torch.allclose(both[key][0], alone[key][0], atol=1e-5), key
    for engine in (actor, critic, reference, reward):
        engine.close()


@pytest.mark.parametrize("padding", ["left", "right"])
def test_scoring_reads_the_logits_generation_sampled_from(monkeypatch, padding):
    """The actor's log-probabilities of its sampled tokens, as scoring
    computes them, are generate()'s own logits' (its output_logits), with
    prompts padded either way: position ids follow HF's rule (counted over
    the mask, a pad at 1). A right-padded prompt's first response token was
    scored 0.011 nats off before, a left-padded one's 0.29."""
    import zero
    from zero.rlhf import PPOSettings, PPOTrainer, ScalarHeadModel
    no_launcher(monkeypatch)
    example = load_example("rlhf_example_positions")
    torch.manual_seed(0)
    actor_model = example.tiny_gpt2()
    actor = zero.initialize(actor_model, optimizer=torch.optim.SGD(actor_model.parameters(),
                                                                   lr=0.1), stage=3)
    critic_model = ScalarHeadModel.from_causal_lm(example.tiny_gpt2())
    critic = zero.initialize(critic_model, optimizer=torch.optim.SGD(
        critic_model.parameters(), lr=0.1), stage=3)
    reference = zero.inference(example.tiny_gpt2(), stage=3)
    reward = zero.inference(ScalarHeadModel.from_causal_lm(example.tiny_gpt2()), stage=3)
    ppo = PPOTrainer(actor, critic, reference, reward,
                     PPOSettings(response_length=example.RESPONSE), pad_token_id=example.PAD)
    prompts = example.Task(seed=3).prompts(2)
    mask = torch.ones_like(prompts)
    pads = slice(0, 2) if padding == "left" else slice(example.PROMPT - 1, example.PROMPT)
    prompts[0, pads], mask[0, pads] = example.PAD, 0
    out = actor.generate(input_ids=prompts, attention_mask=mask, do_sample=False,
                         max_new_tokens=example.RESPONSE, min_new_tokens=example.RESPONSE,
                         pad_token_id=example.PAD, output_logits=True,
                         return_dict_in_generate=True)
    sampled = torch.stack([torch.log_softmax(l.float(), -1) for l in out.logits], 1)
    response = out.sequences[:, example.PROMPT:]
    expected = sampled.gather(-1, response[..., None])[..., 0]
    full_mask = torch.cat([mask, torch.ones_like(response)], 1)
    monkeypatch.setattr(ppo, "generate", lambda p, attention_mask=None: (out.sequences,
                                                                         full_mask))
    experience = ppo.make_experience(prompts, mask)
    assert torch.allclose(experience["logprobs"], expected, atol=1e-5)
    for engine in (actor, critic, reference, reward):
        engine.close()

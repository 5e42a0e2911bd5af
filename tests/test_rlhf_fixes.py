"""zero.rlhf's defects an outside tester found, each against an independent
reference: the scalar head's width on OPT (word_embed_proj_dim), position
ids in sft_loss and reward_loss for left-padded rows, PPO sampling from
PPO's settings only (not the actor's generation_config), the sampling
temperature in the log-probabilities, and the errors that name a wrong
argument. Tiny models, one process, fp32, eval mode where numbers are
compared."""
import copy

import pytest
import torch

import zero
from engine_cases import no_launcher
from zero.rlhf import (PPOSettings, PPOTrainer, ScalarHeadModel, pairwise_loss,
                       response_labels, reward_loss, sft_loss)

transformers = pytest.importorskip("transformers")

VOCAB, PAD = 32, 0


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    no_launcher(monkeypatch)


def gpt2(seed, **config):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        pad_token_id=PAD, **config))


def trained(model, stage=3):
    return zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           stage=stage)


def ppo_of(actor_model, settings, reference=None, critic_model=None, reward_model=None,
           **kwargs):
    """A PPOTrainer on tiny models: actor and critic at stage 3, the
    reference and reward model under zero.inference."""
    reference = reference if reference is not None else copy.deepcopy(actor_model)
    critic_model = critic_model if critic_model is not None else \
        ScalarHeadModel.from_causal_lm(gpt2(7))
    reward_model = reward_model if reward_model is not None else \
        ScalarHeadModel.from_causal_lm(gpt2(8))
    return PPOTrainer(trained(actor_model), trained(critic_model),
                      zero.inference(reference, stage=3), zero.inference(reward_model, stage=3),
                      settings, pad_token_id=PAD, **kwargs)


def close(ppo):
    for engine in (ppo.actor, ppo.critic, ppo.reference, ppo.reward):
        engine.close()


# ---- 1. the scalar head's width ------------------------------------------------------

def test_a_scalar_head_on_opt_reads_the_projected_width():
    """OPT with word_embed_proj_dim != hidden_size (OPT-350m, DeepSpeed-Chat's
    default critic) outputs word_embed_proj_dim-wide states: the head is
    as wide as the LM's own head reads (it was hidden_size: a shape error)."""
    torch.manual_seed(0)
    lm = transformers.OPTForCausalLM(transformers.OPTConfig(
        hidden_size=64, word_embed_proj_dim=32, num_hidden_layers=2, ffn_dim=128,
        num_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=64)).eval()
    rm = ScalarHeadModel.from_causal_lm(lm).eval()
    assert rm.head.in_features == 32 == lm.lm_head.in_features
    ids = torch.randint(2, VOCAB, (2, 6))
    with torch.no_grad():
        hidden = lm.model(input_ids=ids)[0]  # what the LM head reads
        assert torch.allclose(lm.lm_head(hidden), lm(input_ids=ids).logits, atol=1e-6)
        assert torch.allclose(rm(ids), (hidden @ rm.head.weight.T).squeeze(-1), atol=1e-6)


# ---- 2. position ids in steps 1 and 2 ---------------------------------------------

def left_padded(rows, length):
    """rows (token lists) left-padded to length, and their masks."""
    ids = torch.full((len(rows), length), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, length - len(row):] = torch.tensor(row)
        mask[i, length - len(row):] = 1
    return ids, mask


def test_sft_loss_of_a_left_padded_row_is_the_rows_own():
    """A row left-padded with its mask gives the unpadded row's loss, as
    HF's plain model computes it (position ids counted over the mask;
    counted over the pads its loss was 0.05 off)."""
    model = gpt2(0)
    torch.manual_seed(1)
    prompt, response = torch.randint(2, VOCAB, (1, 3)), torch.randint(2, VOCAB, (1, 5))
    alone = torch.cat([prompt, response], 1)
    with torch.no_grad():
        expected = model.eval()(input_ids=alone, labels=response_labels(alone, 3)).loss
    engine = trained(model)
    engine.eval()
    padded, mask = left_padded(alone.tolist(), 11)
    with torch.no_grad():
        got = sft_loss(engine, padded, 6, attention_mask=mask)
    assert abs(float(got) - float(expected)) < 1e-6, (float(got), float(expected))
    engine.close()


def test_reward_loss_of_left_padded_rows_is_the_rows_own():
    """Chosen and rejected left-padded by different amounts score as the
    unpadded rows do in the plain model (their last token's number): the
    loss is the pairwise loss of those scores."""
    rm = ScalarHeadModel.from_causal_lm(gpt2(0)).eval()
    g = torch.Generator().manual_seed(2)
    chosen = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 8)]
    rejected = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (7, 4)]
    with torch.no_grad():
        def score(row):
            return rm(torch.tensor([row]))[0, -1]
        good = torch.stack([score(r) for r in chosen])
        bad = torch.stack([score(r) for r in rejected])
    expected = pairwise_loss(good, bad)
    engine = trained(rm)
    engine.eval()
    c, cm = left_padded(chosen, 8)
    r, rmask = left_padded(rejected, 8)
    with torch.no_grad():
        loss, accuracy = reward_loss(engine, c, r, cm, rmask)
    assert abs(float(loss) - float(expected)) < 1e-6, (float(loss), float(expected))
    assert accuracy == float((good > bad).float().mean())
    engine.close()


# ---- 4. sampling from PPO's settings only --------------------------------------------

def test_ppo_samples_ignore_the_actors_generation_config():
    """An actor whose generation_config carries no_repeat_ngram_size and a
    repetition_penalty (as a checkpoint's generation_config.json can)
    samples what the same actor without them samples, seed for seed, and
    what HF's generate samples from the plain model with PPO's settings;
    its generation_config is its own again after. Before, every response
    of 12 tokens had no repeated token (no_repeat_ngram_size=1 applied)."""
    prompts = torch.randint(1, VOCAB, (16, 3), generator=torch.Generator().manual_seed(0))
    settings = PPOSettings(response_length=12, temperature=0.8)
    samples = []
    for carried in (False, True):
        actor_model = gpt2(0)
        own = actor_model.generation_config
        if carried:
            own.no_repeat_ngram_size, own.repetition_penalty = 1, 1.5
        ppo = ppo_of(actor_model, settings)
        torch.manual_seed(5)
        sequences, _mask = ppo.generate(prompts)
        samples.append(sequences)
        assert actor_model.generation_config is own
        assert own.no_repeat_ngram_size == 1 or not carried  # left as it was
        close(ppo)
    plain = gpt2(0).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        expected = plain.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                  do_sample=True, temperature=0.8, top_k=0, top_p=1.0,
                                  max_new_tokens=12, min_new_tokens=12, pad_token_id=PAD)
    assert torch.equal(samples[0], expected)
    assert torch.equal(samples[1], expected)
    repeats = sum(len(r) - len(set(r)) for r in samples[1][:, 3:].tolist())
    assert repeats > 0  # the carried setting would have made this 0


# ---- 5. the temperature in the log-probabilities -------------------------------------

def test_the_log_probabilities_are_the_sampling_policys_at_a_temperature(monkeypatch):
    """At temperature 0.5 the actor's stored log-probabilities are those of
    the distribution generate sampled from (its processed scores, logits /
    0.5), the KL is of the reference's logits / 0.5 written out by hand, and
    the first training forward's ratio is 1: with whitening off, one epoch
    and one micro-batch, the policy loss is -mean(advantages). Before, raw
    logits were used: the ratio of the first update was not 1."""
    t, response = 0.5, 5
    actor_model, reference = gpt2(0), gpt2(1)
    by_hand = copy.deepcopy(reference).eval()  # the engine partitions its own
    ppo = ppo_of(actor_model, PPOSettings(response_length=response, temperature=t,
                                          whiten_advantages=False), reference=reference)
    prompts = torch.randint(1, VOCAB, (4, 3), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    out = ppo.actor.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                             do_sample=True, temperature=t, top_k=0, top_p=1.0,
                             max_new_tokens=response, min_new_tokens=response,
                             pad_token_id=PAD, output_scores=True,
                             return_dict_in_generate=True)
    sequences = out.sequences
    tokens = sequences[:, 3:]
    sampled = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
    expected = sampled.gather(-1, tokens[..., None])[..., 0]
    mask = torch.ones_like(sequences)
    monkeypatch.setattr(ppo, "generate", lambda p, attention_mask=None: (sequences, mask))
    experience = ppo.make_experience(prompts)
    assert torch.allclose(experience["logprobs"], expected, atol=1e-5)
    with torch.no_grad():  # the reference's, by hand
        logits = by_hand(input_ids=sequences).logits[:, 2:-1].float() / t
        ref = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    kl = float((expected - ref).mean())
    assert abs(experience["kl"] - kl) < 1e-5 * max(1.0, abs(kl)), (experience["kl"], kl)
    assert abs(kl) > 0.01  # two different models
    stats = ppo.train(experience)
    mean_advantage = float(experience["advantages"].mean())
    assert abs(stats["actor_loss"] + mean_advantage) < 1e-5, (stats, mean_advantage)
    close(ppo)


# ---- 6. errors that name the argument ------------------------------------------------

@pytest.fixture
def ppo():
    made = ppo_of(gpt2(0), PPOSettings(response_length=3))
    yield made
    close(made)


def test_one_dimensional_prompts_are_refused(ppo):
    with pytest.raises(ValueError, match=r"prompts must be a \(batch, tokens\)"):
        ppo.step(torch.randint(1, VOCAB, (5,)))
    with pytest.raises(ValueError, match="attention_mask must have the prompts' shape"):
        ppo.step(torch.randint(1, VOCAB, (2, 5)), torch.ones(2, 3, dtype=torch.long))


def test_a_causal_lm_as_critic_is_refused():
    made = ppo_of(gpt2(0), PPOSettings(response_length=3), critic_model=gpt2(2))
    with pytest.raises(ValueError, match="the critic must be a ScalarHeadModel-like model"):
        made.step(torch.randint(1, VOCAB, (2, 3)))
    close(made)


def test_a_sequence_classifier_as_reward_is_refused_by_name():
    torch.manual_seed(1)
    classifier = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, num_labels=1, pad_token_id=PAD))
    made = ppo_of(gpt2(0), PPOSettings(response_length=3), reward_model=classifier)
    with pytest.raises(ValueError, match="the reward must be a ScalarHeadModel-like.*"
                                         "sequence-classification model is not taken"):
        made.step(torch.randint(1, VOCAB, (2, 3)))
    close(made)


def test_a_list_of_eos_ids_ends_a_response_at_any_of_them(ppo, monkeypatch):
    """eos_token_id=[a, b]: each response ends (its mask 0 after) at its
    first a or b, written out here; a real iteration runs (it failed on
    .long() of a bool)."""
    made = PPOTrainer(ppo.actor, ppo.critic, ppo.reference, ppo.reward,
                      PPOSettings(response_length=4), pad_token_id=PAD, eos_token_id=[5, 6])
    prompts = torch.full((3, 2), 9)
    fixed = torch.cat([prompts, torch.tensor([[7, 6, 5, 8], [7, 8, 5, 6], [7, 8, 9, 10]])], 1)
    with monkeypatch.context() as patch:
        patch.setattr(ppo.actor, "generate", lambda **kwargs: fixed)
        sequences, mask = made.generate(prompts)
    assert torch.equal(sequences, fixed)
    assert mask[:, 2:].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    stats = made.step(torch.randint(1, VOCAB, (2, 3)))
    assert torch.isfinite(torch.tensor(stats["actor_loss"]))
    for bad in ("5", [], [5, "6"], 5.0):
        with pytest.raises(ValueError, match="eos_token_id must be"):
            PPOTrainer(ppo.actor, ppo.critic, ppo.reference, ppo.reward,
                       PPOSettings(response_length=4), eos_token_id=bad)


@pytest.mark.parametrize("prompt_length", [8, 20, -2, 2.5])
def test_sft_loss_refuses_a_prompt_length_that_leaves_no_response(prompt_length):
    """A prompt as long as the sequence had a NaN loss; a negative one
    trained on the sequence's tail, prompt included."""
    engine = trained(gpt2(0))
    with pytest.raises(ValueError, match="prompt_length must be"):
        sft_loss(engine, torch.randint(1, VOCAB, (2, 8)), prompt_length)
    engine.close()

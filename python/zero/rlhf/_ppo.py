"""DeepSpeed-Chat's third step: PPO on zero engines. The actor (a causal
LM) and the critic (a ScalarHeadModel) train, each in its own engine at
any stage; the reference (the actor before PPO) and the reward model run
frozen, as zero.inference engines (partitioned) or plain modules. The
actor generates through engine.generate, the hybrid engine: a stage-3
actor is gathered once per generation, not once per token.

[Note: one PPO iteration]
1. generation: the actor samples a response of `response_length` tokens
   for each prompt (ending early at eos_token_id, or any of a list of
   them, when given), from PPO's sampling settings only (_sampling_only).
   Generation and scoring run with all four models in eval mode (no
   dropout: the same sequence scores the same, and an actor equal to its
   reference has a KL of exactly 0), each put back in its mode after, as
   DeepSpeed-Chat's generate_experience does;
2. scoring, without gradients: the actor's and the reference's
   log-probabilities of the sampled tokens (of softmax(logits /
   temperature), the distribution sampled from; the training forward's
   too), the critic's values of the states before each of them, the
   reward model's score of the whole sequence; the per-token reward is
   -kl_coef (log p_actor - log p_ref), with the score (clipped to
   +-clip_reward) added at the last token;
   advantages by GAE (gamma, lam), whitened over the batch of every
   data-parallel rank together (before, each rank's own: an iteration on
   2 ranks was not the one on their batches as one, its actor 0.4-0.6
   relative apart after an iteration);
3. training, ppo_epochs times over the batch (in
   gradient_accumulation_steps micro-batches per engine): the actor on the
   clipped policy loss, the critic on the clipped value loss;
4. with ema set, an exponential moving average of the actor's weights
   (full_state_dict, a collective; as DeepSpeed-Chat's actor EMA).
The time of each phase is returned with the statistics.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from zero.rlhf._losses import gae, masked_mean, policy_loss, token_logprobs, value_loss, whiten
from zero.rlhf._models import position_ids, sequence_scores, takes_position_ids


@dataclass
class PPOSettings:
    response_length: int
    kl_coef: float = 0.05
    gamma: float = 1.0
    lam: float = 0.95
    clip_policy: float = 0.2
    clip_value: float = 0.2
    clip_reward: float = 5.0
    ppo_epochs: int = 1
    temperature: float = 1.0
    whiten_advantages: bool = True
    ema: float | None = None  # e.g. 0.992: the actor's weights averaged

    def __post_init__(self):
        """Each setting by name: before, a NaN gamma made the actor's weights
        NaN, a negative clip_reward clamped every score to it, ppo_epochs 0
        divided by zero after generating and scoring."""
        def number(name, low, high=math.inf, integer=False, low_open=False):
            value = getattr(self, name)
            kind = int if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or \
                    not (low < value if low_open else low <= value) or not value <= high:
                what = "an integer" if integer else "a number"
                raise ValueError(f"PPOSettings.{name} must be {what} in "
                                 f"{'(' if low_open else '['}{low}, {high}], got {value!r}")
        number("response_length", 1, integer=True)
        number("ppo_epochs", 1, integer=True)
        number("kl_coef", 0)
        for name in ("gamma", "lam"):
            number(name, 0, 1)
        for name in ("clip_policy", "clip_value", "clip_reward", "temperature"):
            number(name, 0, low_open=True)
        if not isinstance(self.whiten_advantages, bool):
            raise ValueError(f"PPOSettings.whiten_advantages must be True or False, got "
                             f"{self.whiten_advantages!r}")
        if self.ema is not None:
            number("ema", 0, 1, low_open=True)


class PPOTrainer:
    def __init__(self, actor, critic, reference, reward, settings: PPOSettings,
                 pad_token_id: int = 0, eos_token_id: int | list | None = None):
        for name, engine in (("actor", actor), ("critic", critic)):
            if getattr(engine, "inference_only", True) or not hasattr(engine, "step"):
                raise ValueError(f"PPOTrainer: {name} must be a training engine "
                                 "(zero.initialize), not a module or zero.inference's")
        if not isinstance(settings, PPOSettings):
            raise TypeError(f"settings must be a zero.rlhf.PPOSettings, got "
                            f"{type(settings).__name__}")
        self.actor, self.critic = actor, critic
        self.reference, self.reward = reference, reward
        self.settings = settings
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        # a list of eos ids (as HF's generate takes): any of them ends a
        # response (a list failed on .long() of a bool after generating)
        ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        if eos_token_id is not None and (
                not isinstance(ids, (list, tuple)) or not ids or
                not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ValueError(f"PPOTrainer: eos_token_id must be None, a token id or a list of "
                             f"them, got {eos_token_id!r}")
        self._eos_ids = None if eos_token_id is None else list(ids)
        self.ema_state = None
        # which models take position ids, read once: a signature a forward
        self._positioned = {id(m): takes_position_ids(getattr(m, "module", m))
                            for m in (actor, critic, reference, reward)}

    def _inputs(self, model, sequences, mask) -> dict:
        """A forward's inputs over sampled sequences: the ids, the mask, and,
        where the model takes them, position ids counted over the mask, as
        HuggingFace's generate counts them for left-padded prompts. Without
        them a left-padded row was scored and trained at other positions than
        it was sampled at (its log-probabilities 0.29 nats off in a tiny
        GPT-2), so the ratio of the policy loss was not the sampling policy's."""
        inputs = {"input_ids": sequences, "attention_mask": mask}
        if self._positioned[id(model)]:
            # HF's rule (a pad's position is 1, which a right-padded prompt's
            # last pad, whose logits score the first response token, was
            # sampled at), shared with sft_loss and reward_loss
            inputs["position_ids"] = position_ids(mask)
        return inputs

    def _check_batch(self, prompts, attention_mask):
        """The prompts (and mask) checked before anything is generated, the
        verdict agreed over the actor's data-parallel ranks: a batch that
        does not split into an engine's micro-batches was refused by
        _epoch on its rank alone, after generating and scoring, and the
        other ranks waited in their next collective."""
        problem = None
        if not torch.is_tensor(prompts) or prompts.dim() != 2:
            problem = ("PPO: prompts must be a (batch, tokens) tensor of token ids, got " +
                       (f"shape {tuple(prompts.shape)}" if torch.is_tensor(prompts)
                        else type(prompts).__name__))
        elif attention_mask is not None and (not torch.is_tensor(attention_mask) or
                                             attention_mask.shape != prompts.shape):
            problem = (f"PPO: attention_mask must have the prompts' shape "
                       f"{tuple(prompts.shape)}, got "
                       f"{tuple(getattr(attention_mask, 'shape', ())) or attention_mask!r}")
        else:
            for name, engine in (("actor", self.actor), ("critic", self.critic)):
                count = engine.config.gradient_accumulation_steps
                if prompts.shape[0] % count:
                    problem = (f"PPO: a batch of {prompts.shape[0]} prompts does not split "
                               f"into the {name}'s gradient_accumulation_steps={count} "
                               "micro-batches")
                    break
        refused = torch.tensor([float(problem is not None)], device=self.actor.device)
        self._sum_over_ranks(refused)
        if problem is not None:
            raise ValueError(problem)
        if refused.item():
            raise ValueError("PPO: another rank's batch was refused (its error says why); no "
                             "rank generates")

    def _sum_over_ranks(self, tensor):
        """tensor summed in place over the actor engine's data-parallel
        ranks (its group; tensor-parallel ranks, which share a batch, are
        not in it)."""
        self.actor._comm.everyone.all_reduce_sum(tensor)

    # ---- 1. generation -----------------------------------------------------------

    def generate(self, prompts, attention_mask=None) -> tuple:
        """(sequences, attention mask): prompts and sampled responses, the
        mask 0 past each response's eos."""
        s = self.settings
        self._check_batch(prompts, attention_mask)
        ones = torch.ones_like(prompts)
        prompt_mask = ones if attention_mask is None else attention_mask
        with _sampling_only(self.actor, s, self.pad_token_id, self._eos_ids) as config:
            sequences = self.actor.generate(input_ids=prompts, attention_mask=prompt_mask,
                                            generation_config=config)
        response = sequences[:, prompts.shape[1]:]
        if response.shape[1] < s.response_length:  # every row ended early
            pad = torch.full((response.shape[0], s.response_length - response.shape[1]),
                             self.pad_token_id, dtype=response.dtype, device=response.device)
            response = torch.cat([response, pad], dim=1)
        valid = torch.ones_like(response)
        if self._eos_ids is not None:  # up to and with the first eos
            is_eos = torch.isin(response, torch.tensor(self._eos_ids, device=response.device))
            ended = is_eos.long().cumsum(dim=1)
            valid = ((ended == 0) | ((ended == 1) & is_eos)).long()
        return torch.cat([prompts, response], dim=1), torch.cat([prompt_mask, valid], dim=1)

    # ---- 2. scoring -----------------------------------------------------------------

    def make_experience(self, prompts, attention_mask=None) -> dict:
        with torch.no_grad(), _evaluating(self.actor, self.critic, self.reference, self.reward):
            return self._experience(prompts, attention_mask)

    def _experience(self, prompts, attention_mask) -> dict:
        s, start = self.settings, time.perf_counter()
        sequences, mask = self.generate(prompts, attention_mask)
        generated = time.perf_counter()
        p, t = prompts.shape[1], s.temperature
        # the log-probabilities of the policy that sampled: softmax(logits / t)
        logprobs = token_logprobs(
            self.actor(**self._inputs(self.actor, sequences, mask)).logits, sequences, p, t)
        ref_logprobs = token_logprobs(self.reference(
            **self._inputs(self.reference, sequences, mask)).logits, sequences, p, t)
        values = _numbers("critic", self.critic(**self._inputs(self.critic, sequences, mask)),
                          sequences)[:, p - 1:-1]
        scores = sequence_scores(_numbers(
            "reward", self.reward(**self._inputs(self.reward, sequences, mask)), sequences), mask)
        action_mask = mask[:, p:].float()
        kl = (logprobs - ref_logprobs) * action_mask
        rewards = -s.kl_coef * kl
        last = action_mask.sum(dim=1).long().clamp(min=1) - 1
        rewards[torch.arange(len(last)), last] += scores.clamp(-s.clip_reward, s.clip_reward)
        advantages, returns = gae(rewards, values, action_mask, s.gamma, s.lam)
        if s.whiten_advantages:
            advantages = whiten(advantages, action_mask, self._sum_over_ranks)
        return {"sequences": sequences, "attention_mask": mask, "prompt_length": p,
                "logprobs": logprobs, "values": values, "advantages": advantages,
                "returns": returns, "action_mask": action_mask, "scores": scores,
                "kl": float(masked_mean(kl, action_mask)),
                "generation_s": generated - start,
                "scoring_s": time.perf_counter() - generated}

    # ---- 3. training ----------------------------------------------------------------

    def train(self, experience: dict) -> dict:
        start = time.perf_counter()
        if self.settings.ema is not None and self.ema_state is None:
            # the average starts from the weights before PPO's first update,
            # as DeepSpeed-Chat's EMA copy of the actor does (it started from
            # those after the first iteration's)
            self.ema_state = {k: v.detach().float().clone()
                              for k, v in self.actor.full_state_dict().items()}
        actor_losses, critic_losses = [], []
        for _ in range(self.settings.ppo_epochs):
            actor_losses += self._epoch(self.actor, experience, self._actor_loss)
            critic_losses += self._epoch(self.critic, experience, self._critic_loss)
        if self.settings.ema is not None:
            self._update_ema()
        return {"actor_loss": sum(actor_losses) / len(actor_losses),
                "critic_loss": sum(critic_losses) / len(critic_losses),
                "training_s": time.perf_counter() - start}

    def _epoch(self, engine, experience, loss_of) -> list:
        """One pass over the batch in the engine's accumulation micro-batches."""
        count = engine.config.gradient_accumulation_steps
        rows = experience["sequences"].shape[0]
        if rows % count:
            raise ValueError(f"PPO: a batch of {rows} prompts does not split into "
                             f"gradient_accumulation_steps={count} micro-batches")
        losses = []
        for part in torch.arange(rows).chunk(count):
            batch = {k: v[part] if torch.is_tensor(v) and v.dim() > 0 else v
                     for k, v in experience.items()}
            loss = loss_of(batch)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        return losses

    def _actor_loss(self, batch) -> torch.Tensor:
        logits = self.actor(**self._inputs(self.actor, batch["sequences"],
                                      batch["attention_mask"])).logits
        logprobs = token_logprobs(logits, batch["sequences"], batch["prompt_length"],
                                  self.settings.temperature)
        return policy_loss(logprobs, batch["logprobs"], batch["advantages"],
                           batch["action_mask"], self.settings.clip_policy)

    def _critic_loss(self, batch) -> torch.Tensor:
        p = batch["prompt_length"]
        values = self.critic(**self._inputs(self.critic, batch["sequences"],
                                            batch["attention_mask"]))
        return value_loss(values[:, p - 1:-1], batch["values"], batch["returns"],
                          batch["action_mask"], self.settings.clip_value)

    def _update_ema(self):
        decay = self.settings.ema
        state = self.actor.full_state_dict()
        for key, value in state.items():
            self.ema_state[key].mul_(decay).add_(value.float(), alpha=1 - decay)

    # ---- the iteration --------------------------------------------------------------

    def step(self, prompts, attention_mask=None) -> dict:
        """One PPO iteration ([Note: one PPO iteration]); its statistics:
        the mean reward-model score, the KL to the reference, the losses
        and the seconds of generation, scoring and training."""
        experience = self.make_experience(prompts, attention_mask)
        stats = self.train(experience)
        stats.update(score=float(experience["scores"].mean()), kl=experience["kl"],
                     generation_s=experience["generation_s"],
                     scoring_s=experience["scoring_s"], sequences=experience["sequences"])
        return stats


def _numbers(name, out, sequences):
    """The critic's or reward model's output checked to be a ScalarHeadModel's:
    a causal LM's output failed on "tuple indices", an HF sequence
    classifier's on .gather."""
    if torch.is_tensor(out) and out.shape == sequences.shape:
        return out
    what = f"shape {tuple(out.shape)}" if torch.is_tensor(out) else type(out).__name__
    hint = ""
    if type(out).__name__.startswith("SequenceClassifier"):
        # refused, not read: HF pools its last token by pad_token_id, which a
        # sampled pad id inside a response or another pad id would move
        hint = (" (a HuggingFace sequence-classification model is not taken: it picks "
                "the scored token by pad_token_id, not by the attention mask; put its "
                "transformer under ScalarHeadModel)")
    raise ValueError(f"PPO: the {name} must be a ScalarHeadModel-like model returning one "
                     f"number per token, (batch, tokens) = {tuple(sequences.shape)}; it "
                     f"returned {what}{hint}")


@contextlib.contextmanager
def _sampling_only(actor, settings, pad_token_id, eos_ids):
    """A GenerationConfig of PPO's sampling settings only, with the actor's
    model reading it as its generation_config meanwhile. Before, the
    model's own generation_config (a checkpoint's repetition_penalty,
    no_repeat_ngram_size, bad_words_ids, ...) filled what PPO left unset,
    so the samples were not from the policy whose log-probabilities are
    stored (off-policy). A passed generation_config alone is not enough:
    transformers 4.57 fills its default-valued fields from the model's
    (unless use_model_defaults=False), 5.x its unset (None) fields."""
    from transformers import GenerationConfig
    config = GenerationConfig(
        do_sample=True, temperature=settings.temperature, top_k=0, top_p=1.0,
        max_new_tokens=settings.response_length,
        min_new_tokens=settings.response_length if eos_ids is None else 0,
        pad_token_id=pad_token_id, eos_token_id=eos_ids)
    model = getattr(actor, "module", actor)
    unwrap = getattr(model, "get_base_model", None)  # PEFT copies the base's over
    owner = unwrap() if callable(unwrap) else model
    saved = owner.__dict__.get("generation_config")
    owner.generation_config = config
    try:
        yield config
    finally:
        if saved is None:
            del owner.generation_config
        else:
            owner.generation_config = saved


@contextlib.contextmanager
def _evaluating(*models):
    """The models in eval mode inside, each in its own mode again after."""
    modes = [(m, m.training) for m in models if isinstance(m, torch.nn.Module)]
    for m, _ in modes:
        m.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.train(training)

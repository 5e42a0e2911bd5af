"""The losses and estimators of DeepSpeed-Chat's three steps, as plain
functions of tensors (no engine): the supervised fine-tuning loss on
response tokens, the reward model's pairwise loss, the log-probabilities
of sampled tokens, generalized advantage estimation, and PPO's clipped
policy and value losses. Each masked mean divides by the mask's count."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def response_labels(input_ids: torch.Tensor, prompt_length: int,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Labels for the SFT loss: the sequence, with the prompt and padding
    set to -100 (ignored), so only the response is learned."""
    labels = input_ids.clone()
    labels[:, :prompt_length] = -100
    if attention_mask is not None:
        labels[attention_mask == 0] = -100
    return labels


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """The reward model's loss: -log sigmoid(r_chosen - r_rejected), mean
    over pairs (InstructGPT's, DeepSpeed-Chat's)."""
    return -F.logsigmoid(chosen - rejected).mean()


def token_logprobs(logits: torch.Tensor, sequences: torch.Tensor,
                   prompt_length: int, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) of each response token (positions prompt_length...),
    from the logits of the whole sequence: (batch, response tokens). With
    a temperature, of softmax(logits / temperature): the distribution
    generation sampled from (as TRL's PPO divides them)."""
    logits = logits[:, prompt_length - 1:-1].float()
    if temperature != 1.0:  # at 1 the very same float work as before
        logits = logits / temperature
    tokens = sequences[:, prompt_length:]
    return torch.log_softmax(logits, dim=-1).gather(2, tokens[..., None]).squeeze(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple:
    """Generalized advantage estimation over each response (Schulman et
    al. 2016): delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t +
    gamma lam A_{t+1}, with V and A zero past the response's end.
    Returns (advantages, returns = advantages + values)."""
    values = values * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        following = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * following - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, advantages + values


def whiten(x: torch.Tensor, mask: torch.Tensor, sum_over_ranks=None) -> torch.Tensor:
    """x's masked elements made mean 0 and variance 1 (population). With
    sum_over_ranks (an in-place sum of a tensor over the data-parallel
    ranks) the mean and variance are those of every rank's batch together,
    so an iteration on N ranks is the one on their batches as one."""
    totals = torch.stack([(x * mask).sum(), mask.sum()])
    if sum_over_ranks is not None:
        sum_over_ranks(totals)
    count = totals[1].clamp(min=1)
    mean = totals[0] / count
    squares = (((x - mean) ** 2) * mask).sum().reshape(1)
    if sum_over_ranks is not None:
        sum_over_ranks(squares)
    return (x - mean) * torch.rsqrt(squares[0] / count + 1e-8) * mask


def policy_loss(logprobs, old_logprobs, advantages, mask, clip: float) -> torch.Tensor:
    """PPO's clipped surrogate: max(-A r, -A clip(r, 1 - e, 1 + e)), r the
    probability ratio of the new policy to the one that sampled."""
    ratio = torch.exp(logprobs - old_logprobs)
    loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))
    return masked_mean(loss, mask)


def value_loss(values, old_values, returns, mask, clip: float) -> torch.Tensor:
    """The critic's clipped loss: 0.5 max((V - R)^2, (V_clipped - R)^2),
    V_clipped kept within `clip` of the values at sampling."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask)

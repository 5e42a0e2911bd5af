"""DeepSpeed-Chat's first two steps on zero engines: supervised
fine-tuning of a causal LM on prompt + response (the loss on the
response only), and the reward model's pairwise training on chosen and
rejected responses. Each is one micro-batch's forward and loss; the
caller runs engine.backward(loss) and engine.step() as in any loop."""
from __future__ import annotations

import torch

from zero.rlhf._losses import pairwise_loss, response_labels
from zero.rlhf._models import sequence_scores


def sft_loss(engine, input_ids, prompt_length: int, attention_mask=None) -> torch.Tensor:
    """The causal-LM loss of the response tokens (prompt and padding
    ignored) of a HuggingFace model, run through `engine`."""
    labels = response_labels(input_ids, prompt_length, attention_mask)
    return engine(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def reward_loss(engine, chosen, rejected, chosen_mask=None, rejected_mask=None) -> tuple:
    """(pairwise loss, accuracy: the fraction of pairs scored the right way
    round) of a ScalarHeadModel run through `engine`, the chosen and
    rejected sequences (of one length: pad them) in one forward."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"reward_loss: chosen {tuple(chosen.shape)} and rejected "
                         f"{tuple(rejected.shape)} differ in shape; pad them to one length "
                         "and pass the masks")
    ones = torch.ones_like(chosen)
    mask = torch.cat([ones if chosen_mask is None else chosen_mask,
                      ones if rejected_mask is None else rejected_mask])
    scores = sequence_scores(engine(torch.cat([chosen, rejected]), attention_mask=mask), mask)
    good, bad = scores.chunk(2)
    return pairwise_loss(good, bad), float((good > bad).float().mean())

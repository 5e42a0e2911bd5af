"""DeepSpeed-Chat's first two steps on zero engines: supervised
fine-tuning of a causal LM on prompt + response (the loss on the
response only), and the reward model's pairwise training on chosen and
rejected responses. Each is one micro-batch's forward and loss; the
caller runs engine.backward(loss) and engine.step() as in any loop."""
from __future__ import annotations

import operator

import torch

from zero.rlhf._losses import pairwise_loss, response_labels
from zero.rlhf._models import forward_inputs, sequence_scores


def sft_loss(engine, input_ids, prompt_length: int, attention_mask=None) -> torch.Tensor:
    """The causal-LM loss of the response tokens (prompt and padding
    ignored) of a HuggingFace model, run through `engine`. With a mask,
    position ids are counted over it (a left-padded row's loss is the one
    without its pads), for a model that takes them."""
    # a prompt as long as the sequence left no label (the loss was NaN); a
    # negative one labelled the sequence's tail, prompt included
    try:
        prompt_length = operator.index(prompt_length)
    except TypeError:
        raise ValueError(f"sft_loss: prompt_length must be an integer, got "
                         f"{prompt_length!r}") from None
    if not 0 <= prompt_length < input_ids.shape[-1]:
        raise ValueError(f"sft_loss: prompt_length must be in [0, {input_ids.shape[-1]}) "
                         f"(the sequence has {input_ids.shape[-1]} tokens and the response "
                         f"needs one at least), got {prompt_length}")
    labels = response_labels(input_ids, prompt_length, attention_mask)
    return engine(**forward_inputs(engine, input_ids, attention_mask), labels=labels).loss


def reward_loss(engine, chosen, rejected, chosen_mask=None, rejected_mask=None) -> tuple:
    """(pairwise loss, accuracy: the fraction of pairs scored the right way
    round) of a ScalarHeadModel run through `engine`, the chosen and
    rejected sequences (of one length: pad them) in one forward; with a
    mask given, position ids are counted over it, as sft_loss does."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"reward_loss: chosen {tuple(chosen.shape)} and rejected "
                         f"{tuple(rejected.shape)} differ in shape; pad them to one length "
                         "and pass the masks")
    ones = torch.ones_like(chosen)
    mask = torch.cat([ones if chosen_mask is None else chosen_mask,
                      ones if rejected_mask is None else rejected_mask])
    ids = torch.cat([chosen, rejected])
    inputs = {"input_ids": ids, "attention_mask": mask}
    if chosen_mask is not None or rejected_mask is not None:  # padded: position ids too
        inputs = forward_inputs(engine, ids, mask)
    scores = sequence_scores(engine(**inputs), mask)
    good, bad = scores.chunk(2)
    return pairwise_loss(good, bad), float((good > bad).float().mean())

"""The scalar-head models of RLHF (DeepSpeed-Chat's reward model and
critic): a HuggingFace causal LM's transformer with one linear head that
maps each position's hidden state to a number.

The reward model scores a whole sequence by its last real token's number
(the one after which nothing but padding follows); the critic reads every
position's number as the value of the state before the next token."""
from __future__ import annotations

import inspect

import torch
from torch import nn


class ScalarHeadModel(nn.Module):
    """`backbone` (a HuggingFace transformer without its LM head, e.g.
    GPT2LMHeadModel(...).transformer, LlamaForCausalLM(...).model) and a
    linear head of width 1: forward gives (batch, tokens) numbers."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1, bias=False)
        nn.init.normal_(self.head.weight, std=1.0 / (hidden_size + 1) ** 0.5)

    @classmethod
    def from_causal_lm(cls, lm: nn.Module) -> "ScalarHeadModel":
        """The LM's transformer (its own parameters, not a copy) with a new
        head. A PEFT model (LoRA) gives the transformer inside it, adapters
        included: its own base_model is the whole LM, head and all."""
        unwrap = getattr(lm, "get_base_model", None)
        if callable(unwrap):
            lm = unwrap()
        backbone = getattr(lm, "base_model", None)
        if backbone is None or backbone is lm:
            raise ValueError(f"{type(lm).__name__} has no base_model to put a scalar head "
                             "on; pass a HuggingFace causal LM (GPT2LMHeadModel, "
                             "LlamaForCausalLM, ...)")
        # the width the LM's own head reads: OPT's backbone (OPT-350m,
        # DeepSpeed-Chat's default critic) projects hidden_size down to
        # word_embed_proj_dim, so a head of hidden_size could not take it
        lm_head = getattr(lm, "get_output_embeddings", lambda: None)()
        width = lm_head.in_features if isinstance(lm_head, nn.Linear) else \
            lm.config.hidden_size
        return cls(backbone, width)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        extra = {} if position_ids is None else {"position_ids": position_ids}
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **extra)[0]
        return self.head(hidden).squeeze(-1).float()


def takes_position_ids(model) -> bool:
    """Whether model's forward takes position_ids (HuggingFace's models
    do; a ScalarHeadModel does when its backbone does)."""
    if isinstance(model, ScalarHeadModel):
        model = model.backbone
    base = getattr(model, "get_base_model", None)  # PEFT's: its forward passes them on
    if callable(base):
        model = base()
    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counted over the mask, HuggingFace's rule for padded
    prompts (prepare_inputs_for_generation): cumsum - 1, a pad at 1. One
    rule for generation, PPO's scoring and training, and sft_loss and
    reward_loss: a left-padded row then scores as it does without its pads
    (counted over the pads, its positions were shifted)."""
    return (attention_mask.long().cumsum(dim=1) - 1).masked_fill_(attention_mask == 0, 1)


def forward_inputs(model, input_ids, attention_mask) -> dict:
    """A forward's keyword inputs: the ids, the mask and, when a mask is
    given and the model (an engine's module) takes them, position_ids."""
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if attention_mask is not None and takes_position_ids(getattr(model, "module", model)):
        inputs["position_ids"] = position_ids(attention_mask)
    return inputs


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last position whose mask is 1 (right padding)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.long() * positions).argmax(dim=1)


def sequence_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The reward model's score of each sequence: its last real token's."""
    return values.gather(1, last_token_index(attention_mask)[:, None]).squeeze(1)

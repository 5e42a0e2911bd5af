"""zero.rlhf: DeepSpeed-Chat's three RLHF steps on zero's engines, for
HuggingFace causal LMs:

1. supervised fine-tuning: `sft_loss(engine, ids, prompt_length)`;
2. a reward model (`ScalarHeadModel.from_causal_lm(lm)`) trained on
   chosen/rejected pairs: `reward_loss(engine, chosen, rejected)`;
3. PPO: `PPOTrainer(actor, critic, reference, reward, PPOSettings(...))`,
   actor and critic trained at any stage, reference and reward model
   frozen (`zero.inference`), the actor generating through the hybrid
   engine (engine.generate).

examples/rlhf/ runs all three on a synthetic preference task
(docs/rlhf.md)."""
from zero.rlhf._losses import (gae, pairwise_loss, policy_loss, response_labels,
                               token_logprobs, value_loss)
from zero.rlhf._models import ScalarHeadModel, sequence_scores
from zero.rlhf._ppo import PPOSettings, PPOTrainer
from zero.rlhf._steps import reward_loss, sft_loss

__all__ = ["ScalarHeadModel", "sequence_scores", "sft_loss", "reward_loss", "PPOSettings",
           "PPOTrainer", "pairwise_loss", "response_labels", "token_logprobs", "gae",
           "policy_loss", "value_loss"]

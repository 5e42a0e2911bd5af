"""TRL's trainers trained by zero: ZeroDPOTrainer, ZeroKTOTrainer,
ZeroGRPOTrainer and ZeroRLOOTrainer are TRL's trainers of those names with
ZeroTrainerMixin first (the same
mechanism as ZeroTrainer: the engine owns the parameters, gradients,
optimizer states, reduction, precision, clipping and the step; the
Trainer keeps the data, accumulation, schedule and logging).

    from zero.integrations.trl import ZeroDPOTrainer
    trainer = ZeroDPOTrainer(model=policy, ref_model=reference, args=DPOConfig(...),
                             train_dataset=pairs, processing_class=tokenizer,
                             zero_options={"stage": 3})

What each adds (docs/hf-trainer.md, "TRL"):
- DPO and KTO (ref_model=), GRPO and RLOO with a KL term (beta > 0; TRL
  loads the reference from the policy's path): the reference model runs
  frozen under zero.inference at stage 3 (partitioned like the policy)
  when the engine's stage is 3 (zero_options' stage, or its config's:
  a DeepSpeed dict or JSON path, or a zero.Config, read as
  zero.initialize reads them), and as TRL prepares it otherwise.
- GRPO and RLOO: generation samples from the policy's module; at stage 3
  its generate goes through the engine's (its parameters gathered once
  per generation, the hybrid engine), not per module and token, as every
  stage-3 model's does ([Note: the model's own generate at stage 3] in
  engine/_generation.py).
TRL 1.16 has no PPOTrainer (zero.rlhf has a PPO of its own).

Importing this module imports trl (pip install trl).
"""
from __future__ import annotations

from trl import DPOTrainer, GRPOTrainer, KTOTrainer, RLOOTrainer

from zero.engine._arguments import resolve_config
from zero.engine._initialize import inference
from zero.integrations._trl_gather import teach_trl_to_gather
from zero.integrations.hf import ZeroTrainerMixin

teach_trl_to_gather()  # [Note: TRL's fused head] in _trl_gather.py


class _ReferenceUnderInference:
    """A trainer with a frozen reference model (DPO and KTO; GRPO and RLOO
    with a KL term, beta > 0): at stage 3 the reference is partitioned like
    the policy under zero.inference."""

    def __init__(self, *args, zero_options: dict | None = None, **kwargs):
        super().__init__(*args, zero_options=zero_options, **kwargs)
        if self.ref_model is None:
            return
        # the engine's settings as zero.initialize reads them: the config (a
        # DeepSpeed dict or path, or a zero.Config), the keywords over it.
        # Only a top-level "stage" was read before, so a stage 3 given in
        # the config left the reference whole on every rank
        options = dict(self.zero_options)
        config = resolve_config(options.pop("config", None), options.pop("stage", None),
                                options.pop("precision", None),
                                {k: v for k, v in options.items() if k not in ("device", "mesh")})
        if config.stage == 3:
            shared = {name: getattr(config, name) for name in (
                "precision", "offload_param", "stage3_param_persistence_threshold",
                "stage3_model_persistence_threshold", "units")}
            shared.update({k: options[k] for k in ("device", "mesh") if k in options})
            self.ref_model = inference(self.ref_model, stage=3, **shared)


class ZeroDPOTrainer(_ReferenceUnderInference, ZeroTrainerMixin, DPOTrainer):
    """TRL's DPOTrainer trained by zero (see the module's docstring)."""


class ZeroKTOTrainer(_ReferenceUnderInference, ZeroTrainerMixin, KTOTrainer):
    """TRL's KTOTrainer trained by zero (see the module's docstring)."""


class ZeroGRPOTrainer(_ReferenceUnderInference, ZeroTrainerMixin, GRPOTrainer):
    """TRL's GRPOTrainer trained by zero (see the module's docstring)."""


class ZeroRLOOTrainer(_ReferenceUnderInference, ZeroTrainerMixin, RLOOTrainer):
    """TRL's RLOOTrainer trained by zero (see the module's docstring)."""

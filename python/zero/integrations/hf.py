"""zero under the HuggingFace Trainer: ZeroTrainer is a Trainer whose model
is trained by a zero Engine.

    from zero.integrations.hf import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                          zero_options={"stage": 3, "precision": "bf16"})
    trainer.train()

The Trainer keeps what it owns: the data loaders (sharded over ranks by
accelerate), gradient accumulation (args.gradient_accumulation_steps), the
LR schedule, logging, evaluation and the checkpoint folders. The engine
takes what it owns: the model's parameters, gradients and optimizer states,
partitioned; the reduction over ranks; mixed precision; clipping (to
args.max_grad_norm, over all shards); the step.

How the two meet, each at a point the Trainer lets a subclass or its own
Accelerator object choose (no torch or transformers global is replaced):
- create_optimizer builds the Trainer's optimizer as usual, hands it to
  zero.initialize, and gives the Trainer a stand-in whose step() is
  engine.step(); the LR scheduler is built on the real optimizer, whose
  param_groups the engine reads.
- _wrap_model returns the engine, so accelerate wraps no DDP around it.
- This Trainer's accelerator sends backward, clip_grad_norm_ and no_sync
  to the engine (the engine reduces at the Trainer's optimizer step, so
  no_sync has nothing to skip), and unwraps the engine to the model.
- save_model writes the full fp32 model (a collective at stages 1-3); the
  optimizer part of a checkpoint folder is a zero checkpoint (any world
  size and stage resumes from it) plus the scheduler; the best model is
  loaded from the best folder's zero checkpoint.
- With zero_options["mesh"] and a tensor-parallel model, the data loaders
  are sharded over the data-parallel ranks only, and a vocabulary-parallel
  loss runs under torch's loss_parallel() (_hf_model_parallel.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import torch
from transformers import Trainer

from zero.checkpoint._format import HF_ZERO_DIR
from zero.config._config import Config
from zero.engine._dcp_preparation import refuse_if_dcp, undo_dcp_preparation
from zero.engine._generation import gathered_whole, gathers_whole
from zero.engine._initialize import initialize
from zero.step._registry import SPECS
from zero.config._schedulers import SCHEDULER_TYPES, scheduler_from_config
from zero.config._deepspeed_config import read_deepspeed
from zero.integrations._trl_gather import teach_trl_to_gather
from zero.integrations._hf_model_parallel import (gather_once_per_data_parallel_place, plain,
                                                  refuse_pipeline,
                                                  shard_data_over_data_parallel_ranks)
from zero.parallel._tensor_parallel import vocabulary_parallel

SCHEDULER_FILE = "scheduler.pt"  # the Trainer's own name for it


class _EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer (and accelerate) take for the optimizer: step() and
    zero_grad() go to the engine; param_groups are the real optimizer's,
    hyperparameters only. The states live in the engine, partitioned, and
    are saved with its checkpoints, so state_dict() holds no "state"."""

    def __init__(self, engine, after_step=lambda: None):
        # no Optimizer.__init__: the engine owns the parameters
        self.engine = engine
        self.after_step = after_step
        self.defaults = engine.optimizer.defaults
        self.state = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("the zero engine's step takes no closure")
        dcp = undo_dcp_preparation(self)  # [Note: DCP's preparation]
        if dcp is not None:
            raise RuntimeError(dcp)
        self.engine.step()
        self.after_step()

    def zero_grad(self, set_to_none: bool = True):
        self.engine.zero_grad(set_to_none)

    def state_dict(self):
        refuse_if_dcp("state_dict")  # [Note: DCP's preparation]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": {}, "param_groups": groups}

    def load_state_dict(self, state_dict):
        refuse_if_dcp("load_state_dict")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, the optimizer "
                             f"has {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})


def _record_fp32(config_path):
    """save_pretrained records the parameters' dtype (the engine's compute
    dtype) in config.json, and from_pretrained loads in it by default
    (transformers 5); the weights written are the fp32 masters, so the
    config says float32."""
    if not os.path.isfile(config_path):
        return
    with open(config_path) as f:
        config = json.load(f)
    changed = False
    for key in ("torch_dtype", "dtype"):
        if key in config and config[key] != "float32":
            config[key] = "float32"
            changed = True
    if changed:
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


# zero.Config fields the Trainer owns (see ZeroTrainer._config_for_trainer)
_CONFIG_TRAINER_OWNS = ("gradient_accumulation_steps", "gradient_clipping",
                        "train_micro_batch_size_per_gpu", "train_batch_size", "optimizer",
                        "scheduler")
# a DeepSpeed config's optimizer type -> the TrainingArguments.optim names
# that build it (DeepSpeed's "Adam" is AdamW unless adam_w_mode is false)
_OPTIMIZER_TYPES = {kind: spec.trainer_optims for spec in SPECS.values()
                    for kind in spec.deepspeed_types}


def _check_optimizer_type(kind, optim: str) -> None:
    """A config's optimizer type must be the optimizer the Trainer builds
    (the Trainer builds it from TrainingArguments.optim)."""
    if kind is None:
        return
    prefixes = _OPTIMIZER_TYPES.get(str(kind).lower())
    if prefixes is None or not optim.startswith(prefixes):
        raise ValueError(f"the config's optimizer type is {kind!r} but TrainingArguments.optim "
                         f"is {optim!r}, and the Trainer builds the optimizer: set "
                         "TrainingArguments.optim to match (or pass optimizers=), and leave "
                         "the type out of the config")


def _synced_generation(kwargs: dict, stored: dict, synced: bool) -> dict:
    """prediction_step's keyword arguments with synced_gpus=synced: its
    generation arguments are the ones given, else those predict() or
    evaluate() stored (Seq2SeqTrainer reads those only when none are
    given, which synced_gpus alone would be)."""
    given = {k: v for k, v in kwargs.items() if k != "ignore_keys"}
    out = {**(given or stored), "synced_gpus": synced}
    if "ignore_keys" in kwargs:
        out["ignore_keys"] = kwargs["ignore_keys"]
    return out


class ZeroTrainerMixin:
    """What makes a transformers.Trainer (or a subclass of it: TRL's
    trainers, zero.integrations.trl) train through zero: put it first,
    `class MyTrainer(ZeroTrainerMixin, SomeTrainer)`. zero_options: the
    keyword arguments of zero.initialize (stage, precision, and any
    zero.Config field) except those the Trainer owns (see _TRAINER_OWNS)."""

    _TRAINER_OWNS = {"gradient_accumulation_steps": "args.gradient_accumulation_steps",
                     "gradient_clipping": "args.max_grad_norm",
                     "optimizer": "args.optim or optimizers=",
                     "lr_scheduler": "args.lr_scheduler_type or optimizers="}

    def __init__(self, *args, zero_options: dict | None = None, **kwargs):
        if zero_options is not None and not isinstance(zero_options, dict):
            raise TypeError("zero_options must be a dict of zero.initialize's options, such "
                            f"as {{'stage': 3}}, got {type(zero_options).__name__} "
                            f"{zero_options!r}")
        options = dict(zero_options or {})
        for key, where in self._TRAINER_OWNS.items():
            if key in options:
                raise ValueError(f"zero_options[{key!r}]: the Trainer owns this; set {where}")
        self.zero_options = options
        self.engine = None
        self._config_scheduler = None  # a DeepSpeed config's scheduler block
        self._config_optimizer = False  # whether the config had an optimizer block
        # under tp: the evaluation gather each evaluation loop installs
        self._gather_once = None
        # before the Trainer's own setup: it acts on these (FSDP wraps the
        # model on the spot) and would fail with its own message, or not at all
        _refuse_other_wrappers(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        if self.args.fp16 or self.args.bf16:
            raise ValueError("TrainingArguments fp16/bf16 turn on torch autocast; with "
                             "ZeroTrainer set zero_options={'precision': 'bf16'} (or 'fp16') "
                             "instead, and leave fp16/bf16 False" +
                             _exported("ACCELERATE_MIXED_PRECISION"))
        for flag in ("fp16_full_eval", "bf16_full_eval"):
            if getattr(self.args, flag, False):
                raise ValueError(f"TrainingArguments.{flag} casts the model for evaluation, "
                                 "which the engine's model cannot be; with ZeroTrainer the "
                                 "model evaluates in zero_options' precision: leave "
                                 f"{flag} False")
        if self.accelerator.mixed_precision not in (None, "no"):
            raise ValueError(f"accelerate runs this Trainer under {self.accelerator.mixed_precision}"
                             " autocast (ACCELERATE_MIXED_PRECISION or an accelerate config "
                             "says so); with ZeroTrainer set zero_options={'precision': ...} "
                             "and unset it")
        if self.args.load_best_model_at_end and self.args.save_only_model:
            raise ValueError("load_best_model_at_end loads the best folder's zero checkpoint, "
                             "which save_only_model=True does not write; unset one of them")
        if "config" in options:
            options["config"] = self._config_for_trainer(options["config"])
        if self._config_scheduler is not None and self.lr_scheduler is not None:
            raise ValueError("the config's scheduler block and optimizers=(..., scheduler) "
                             "both give a schedule; keep one")
        self._route_accelerator_to_engine()
        if options.get("mesh") is not None:
            refuse_pipeline(self.model, options["mesh"])
            if shard_data_over_data_parallel_ranks(self.accelerator, options["mesh"]):
                self._gather_once = gather_once_per_data_parallel_place(
                    self.accelerator, options["mesh"], self.args.eval_use_gather_object)

    def training_step(self, *args, **kwargs):
        with vocabulary_parallel(self.model):
            loss = super().training_step(*args, **kwargs)
        return plain(loss)

    def evaluation_loop(self, *args, **kwargs):
        # the Trainer sets gather_function back to accelerate's at the end
        # of each loop: a second evaluation counted the tp ranks' copies
        if self._gather_once is not None:
            self.gather_function = self._gather_once
        return super().evaluation_loop(*args, **kwargs)

    def prediction_step(self, *args, **kwargs):
        whole = contextlib.nullcontext()
        if self._generates_at_stage_3() and "synced_gpus" not in kwargs:
            # [Note: generation]: gathered whole once for the batch where the
            # model fits (as engine.generate's "auto"), no collective until
            # it ends; else unit by unit, every rank in step (synced_gpus)
            by_units = not gathers_whole(self.engine)
            if not by_units:
                whole = gathered_whole(self.engine)
            kwargs = _synced_generation(kwargs, getattr(self, "_gen_kwargs", None) or {},
                                        synced=by_units)
        with whole, vocabulary_parallel(self.model):
            return plain(super().prediction_step(*args, **kwargs))

    def _generates_at_stage_3(self) -> bool:
        """Seq2SeqTrainer's predict_with_generate at stage 3 over several
        ranks. Unit by unit, each generated token's forward gathers with
        collectives, so a rank whose batch ended first stopped gathering
        while the others went on, and gloo aborted; with synced_gpus (which
        HF turns on by itself under the stage-3 marks) a cacheless
        generation failed on a size mismatch in HF's synced loop. Gathered
        whole, neither arises, and the model is gathered once a batch
        instead of once a token."""
        engine = self.engine
        return getattr(self.args, "predict_with_generate", False) and engine is not None and \
            not engine._closed and engine._schedule is not None and \
            engine._comm.everyone.world > 1

    def _config_for_trainer(self, config):
        """A DeepSpeed config given in zero_options, less what the Trainer
        owns. Such a key may be "auto" or agree with TrainingArguments (it
        is then left to the Trainer, as HuggingFace's DeepSpeed integration
        does); one that disagrees is refused: the engine applying it on top
        of the Trainer would accumulate twice, clip twice or schedule twice.
        An optimizer block may only hold "auto" values and the Trainer's
        type: the Trainer builds it. A scheduler block's type and values
        are honoured in place of the Trainer's schedule (create_scheduler).
        A zero.Config goes through the same checks, field by field."""
        if isinstance(config, Config):
            # its fields at their defaults are unset; the others go through
            # the same checks as a DeepSpeed config's keys
            defaults = Config()
            owned = {k: getattr(config, k) for k in _CONFIG_TRAINER_OWNS
                     if getattr(config, k) != getattr(defaults, k)}
            self._drop_trainer_owned(dict(owned))
            return dataclasses.replace(config, **{k: getattr(defaults, k) for k in owned})
        return self._drop_trainer_owned(dict(read_deepspeed(config)))

    def _drop_trainer_owned(self, config: dict) -> dict:
        """_config_for_trainer's checks on a config as a dict."""
        args = self.args
        owned = {"gradient_accumulation_steps": (args.gradient_accumulation_steps,
                                                 "gradient_accumulation_steps"),
                 "gradient_clipping": (args.max_grad_norm, "max_grad_norm"),
                 "train_micro_batch_size_per_gpu": (args.per_device_train_batch_size,
                                                    "per_device_train_batch_size")}
        for key, (theirs, field) in owned.items():
            if key in config:
                value = config.pop(key)
                if value not in ("auto", None) and value != theirs:  # None: derived
                    raise ValueError(f"the config's {key} is {value!r} but TrainingArguments."
                                     f"{field} is {theirs!r}; the Trainer owns it: set it in "
                                     "TrainingArguments and write \"auto\" (or leave it out) "
                                     "in the config")
        config.pop("train_batch_size", None)  # the Trainer's, across ranks and accumulation
        # the Trainer clips (max_grad_norm) through the engine's clip_grad_norm_;
        # left out, the engine would also clip at DeepSpeed's default of 1.0
        config["gradient_clipping"] = 0.0
        for block in ("fp16", "bf16"):  # "auto": the Trainer's autocast, which is off here
            if isinstance(config.get(block), dict) and config[block].get("enabled") == "auto":
                config[block] = {**config[block], "enabled": False}
        for block in ("optimizer", "scheduler"):
            if config.get(block) is not None and (
                    not isinstance(config[block], dict) or
                    not isinstance(config[block].get("params", {}), dict)):
                raise ValueError(f"the config's {block} must be a block such as "
                                 f"{{\"type\": ..., \"params\": {{...}}}}, got "
                                 f"{config[block]!r}")
        optimizer = config.pop("optimizer", None)
        if optimizer:  # the Trainer builds it: only its type may be named
            if any(v != "auto" for v in (optimizer.get("params") or {}).values()):
                raise ValueError("the config's optimizer block sets values, but the Trainer "
                                 "builds the optimizer: set TrainingArguments (optim, "
                                 "learning_rate, weight_decay, adam_beta1/2, adam_epsilon) or "
                                 "optimizers=, or write \"auto\" for each of its params")
            _check_optimizer_type(optimizer.get("type"),
                                  str(getattr(args.optim, "value", args.optim)))
            self._config_optimizer = True
        scheduler = config.pop("scheduler", None)
        if scheduler:
            # its type and values are honoured, as under HuggingFace's
            # DeepSpeed integration (a WarmupLR config keeps its schedule);
            # those the Trainer also sets must agree (the step counts are
            # checked at create_scheduler)
            if scheduler.get("type") not in SCHEDULER_TYPES:
                raise ValueError(f"the config's scheduler type {scheduler.get('type')!r} is not "
                                 f"supported; choose {', '.join(SCHEDULER_TYPES)}, or drop "
                                 "the block and set TrainingArguments.lr_scheduler_type")
            rate = (scheduler.get("params") or {}).get("warmup_max_lr", "auto")
            if rate != "auto" and rate != args.learning_rate:
                raise ValueError(f"the config's scheduler.params.warmup_max_lr is {rate!r} "
                                 f"but TrainingArguments.learning_rate is {args.learning_rate!r}"
                                 "; set one, and write \"auto\" in the other")
            self._config_scheduler = scheduler
        return config

    # ---- the engine and the optimizer ------------------------------------------

    def create_optimizer(self):
        # Trainer.train with model_init makes a new model and drops the
        # optimizer: a new engine for it, the old one closed
        if self.engine is not None and (self.optimizer is None or self.engine._closed
                                        or self.engine.module is not self.model):
            # closed by the user, on the same model: its optimizer, which
            # close() gave the states back to, trains on (self.optimizer is
            # accelerate's wrapper of the engine's stand-in, which
            # initialize cannot take)
            same = self.engine._closed and self.engine.module is self.model and \
                self.optimizer is not None
            real = self.engine.optimizer if same else None
            self.engine.close()
            self.engine = None
            self.optimizer = real
        if self.engine is None:
            super().create_optimizer()  # the Trainer's optimizer, on the model's parameters
            self.engine = initialize(self.model, optimizer=self.optimizer,
                                          **self.zero_options)
            teach_trl_to_gather()  # [Note: TRL's fused head] (a TRL trainer, or SFT's mixin)
            self.optimizer = _EngineOptimizer(self.engine, after_step=self._report_skipped_step)
        return self.optimizer

    def get_decay_parameter_names(self, model) -> list:
        """With an optimizer block in the config, HuggingFace's DeepSpeed
        integration hands DeepSpeed every trainable parameter in one group,
        so weight_decay reaches biases and norm weights too; the Trainer's
        own optimizer spares them. The same numbers as HF + DeepSpeed: every
        parameter decays then (docs/hf-trainer.md)."""
        if self._config_optimizer:
            return [name for name, _p in model.named_parameters()]
        return super().get_decay_parameter_names(model)

    def _report_skipped_step(self):
        """The Trainer steps its LR scheduler unless accelerate says the
        optimizer step was skipped, and accelerate asks its optimizer
        wrappers, which know only torch's GradScaler: tell them when the
        engine skipped an fp16 step on overflow, as DeepSpeed's engine
        leaves its scheduler alone then."""
        for wrapper in getattr(self.accelerator, "_optimizers", ()):
            if isinstance(getattr(wrapper, "optimizer", None), _EngineOptimizer):
                wrapper._is_overflow = self.engine.step_was_skipped

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        # on the real optimizer: the engine reads the lr from its param_groups
        real = self.engine.optimizer if self.engine is not None else optimizer
        if self._config_scheduler is None:
            return super().create_scheduler(num_training_steps, optimizer=real)
        if self.lr_scheduler is None:
            # "auto" filled from TrainingArguments as HuggingFace's DeepSpeed
            # integration fills it
            auto = {"warmup_min_lr": 0.0, "warmup_max_lr": self.args.learning_rate,
                    "warmup_num_steps": self.args.get_warmup_steps(num_training_steps),
                    "total_num_steps": num_training_steps}
            params = dict(self._config_scheduler.get("params") or {})
            for key, value in params.items():
                if value == "auto" and key not in auto:  # WarmupCosineLR's ratios
                    raise ValueError(f"scheduler.params.{key} is \"auto\", which the Trainer "
                                     "does not fill in; write a number")
                if value == "auto" and key == "warmup_num_steps":
                    # no warm-up asked (warmup_steps 0, the Trainer's default):
                    # DeepSpeed 0.19.8's schedulers refuse 0 and warm up
                    # over at least 2 steps whatever is asked, so 1
                    params[key] = max(1, auto[key])
                elif value == "auto":
                    params[key] = auto[key]
                elif key in ("warmup_num_steps", "total_num_steps") and value != auto[key]:
                    raise ValueError(f"the config's scheduler.params.{key} is {value!r} but "
                                     f"the Trainer's run gives {auto[key]!r}; write \"auto\"")
            self.lr_scheduler = scheduler_from_config(
                {"type": self._config_scheduler.get("type"), "params": params}, real)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _wrap_model(self, model, training=True, dataloader=None):
        # after engine.close() the model is a plain torch model again
        return self.engine if self.engine is not None and not self.engine._closed else model

    def _route_accelerator_to_engine(self):
        """This Trainer's own accelerator: backward, clipping and no_sync
        are the engine's (a plain loss.backward() would miss fp16's loss
        scale; torch's clip_grad_norm_ would see only this rank's unreduced
        or partitioned gradients)."""
        acc = self.accelerator

        def backward(loss, **_kwargs):
            self.engine.backward(loss)

        def clip_grad_norm_(_parameters, max_norm, norm_type=2):
            if norm_type != 2:
                raise ValueError(f"the zero engine clips by the L2 norm, not norm_type={norm_type}")
            return torch.tensor(self.engine.clip_grad_norm_(max_norm))

        unwrap = acc.unwrap_model

        def unwrap_model(model, *args, **kwargs):
            # the Trainer reads the model's class from here (label
            # smoothing shifts a causal LM's labels)
            return self.model if model is self.engine else unwrap(model, *args, **kwargs)

        acc.backward = backward
        acc.clip_grad_norm_ = clip_grad_norm_
        acc.no_sync = lambda model=None: contextlib.nullcontext()
        acc.unwrap_model = unwrap_model

    # ---- saving and resuming ------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The full fp32 model, from the engine's masters, written by the
        process that saves. A collective at every stage, 0 too: call it on
        every rank (not under `if trainer.is_world_process_zero()`)."""
        if self.engine is None or self.engine._closed:  # a plain model now
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = self.engine.full_state_dict()
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
            _record_fp32(os.path.join(output_dir, "config.json"))

    def _save_optimizer_and_scheduler(self, output_dir):
        self.engine.save_checkpoint(os.path.join(output_dir, HF_ZERO_DIR), tag="engine")
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_best_model(self):
        """load_best_model_at_end: the best folder's weights into the
        engine's masters (and so the parameters), every rank."""
        best = os.path.join(self.state.best_model_checkpoint, HF_ZERO_DIR)
        self.engine.load_checkpoint(best, tag="engine", load_module_only=True)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        zero_dir = os.path.join(checkpoint, HF_ZERO_DIR)
        if not os.path.isdir(zero_dir):
            raise FileNotFoundError(
                f"{checkpoint!r} has no {HF_ZERO_DIR}/, so it holds no engine state to "
                "resume: it was saved with save_only_model=True (the weights alone), or not by "
                "ZeroTrainer. To start from its weights, load them into the model "
                "(from_pretrained) and train without resume_from_checkpoint")
        self.engine.load_checkpoint(zero_dir, tag="engine")
        scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """A transformers.Trainer trained by zero (see ZeroTrainerMixin)."""


def _exported(variable) -> str:
    """The refused TrainingArguments exported `variable` already, which the
    next Trainer of this process (a notebook's next cell) would read."""
    if variable not in os.environ:
        return ""
    return (f"; these TrainingArguments exported {variable}={os.environ[variable]} into this "
            f"process's environment: del os.environ[{variable!r}] before the next Trainer")


def _refuse_other_wrappers(training_args):
    """TrainingArguments that hand the model to another wrapper than the
    engine. The Trainer compiles and wraps in accelerate's prepare(), which
    never sees the model once the engine wraps it: torch_compile=True
    trained uncompiled, silently."""
    if getattr(training_args, "torch_compile", False):
        raise ValueError("TrainingArguments.torch_compile: ZeroTrainer's engine wraps the "
                         "model, so the Trainer's compile step never runs and the model would "
                         "train uncompiled; leave torch_compile False")
    if getattr(training_args, "fsdp", None):
        raise ValueError("TrainingArguments.fsdp: FSDP and ZeroTrainer each shard the model; "
                         "use one. With ZeroTrainer set zero_options={'stage': 3} for "
                         "sharded parameters, and leave fsdp unset" +
                         _exported("ACCELERATE_USE_FSDP"))
    if getattr(training_args, "deepspeed", None):
        raise ValueError("TrainingArguments.deepspeed: ZeroTrainer reads a DeepSpeed config "
                         "itself; pass it as zero_options={'config': <path or dict>} and leave "
                         "TrainingArguments.deepspeed unset")
    # after the arguments' own checks, which name the cause: accelerate
    # reads these from the environment (an accelerate config, or an earlier
    # TrainingArguments(fsdp=... / deepspeed=...) in this process, which
    # exports them) and would wrap the model itself
    for variable, what in (("ACCELERATE_USE_FSDP", "FSDP"),
                           ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "y", "on"):
            raise ValueError(
                f"{variable}={os.environ[variable]} in the environment: accelerate would set "
                f"the Trainer up for {what} (an accelerate config says so, or an earlier "
                f"TrainingArguments in this process exported it), and {what} and ZeroTrainer "
                f"each shard the model. Unset it (del os.environ[{variable!r}], or leave "
                f"{what} out of the accelerate config) and use ZeroTrainer's zero_options")

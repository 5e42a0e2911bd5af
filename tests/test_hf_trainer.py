"""zero.integrations.hf.ZeroTrainer in one process against the plain
HuggingFace Trainer on the same model, data and arguments (accumulation,
warm-up and linear schedule, clipping).

Tolerance, fp32: the same forward and backward ops; the updates differ by
rounding (zero's C AdamW against torch's fused AdamW, the clip folded into
the gradient scale), a few ulps a step: final parameters within 1e-5
normwise, gradient norms within 1e-5 relative, logged losses (which the
Trainer rounds to 4 decimals) within one unit of the last.
Checkpoint folders resume bit for bit (same process count)."""
import os

import pytest
import torch

import hf_cases
from conftest import max_rel_error
from hf_trainer_cases import llama, logged, same_logged_loss, token_data, training_args

pytest.importorskip("transformers", reason="requirements-test.txt installs transformers")
one_process = hf_cases.one_process


def zero_trainer(tmp, zero_options, seed=0, eval_dataset=None, **overrides):
    from zero.integrations.hf import ZeroTrainer
    return ZeroTrainer(model=llama(seed), args=training_args(tmp, **overrides),
                       train_dataset=token_data(), eval_dataset=eval_dataset,
                       zero_options=zero_options)


@pytest.fixture(scope="module")
def plain_trainer_run(tmp_path_factory):
    from transformers import Trainer
    trainer = Trainer(model=llama(), args=training_args(tmp_path_factory.mktemp("plain")),
                      train_dataset=token_data())
    trainer.train()
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return state, logged(trainer, "loss"), logged(trainer, "grad_norm")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_the_plain_trainer(one_process, tmp_path, plain_trainer_run, stage):
    ref_state, ref_losses, ref_norms = plain_trainer_run
    trainer = zero_trainer(tmp_path, {"stage": stage})
    trainer.train()
    state = trainer.engine.full_state_dict()
    for ours, ref in zip(logged(trainer, "loss"), ref_losses, strict=True):
        assert same_logged_loss(ours, ref)
    for ours, ref in zip(logged(trainer, "grad_norm"), ref_norms, strict=True):
        assert abs(ours - ref) <= 1e-5 * abs(ref)
    for key, ref in ref_state.items():
        assert max_rel_error(state[key], ref) <= 1e-5, key
    trainer.engine.close()


# HuggingFace's DeepSpeed template, as users bring it: the Trainer's keys
# "auto" or equal to TrainingArguments, an optimizer and scheduler of "auto"
DEEPSPEED_TEMPLATE = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": "auto", "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": "auto",
                                                      "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True},
    "fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
}


@pytest.mark.parametrize("clipping", ["written", "left out"])
def test_deepspeed_config_leaves_the_trainers_keys_to_the_trainer(one_process, tmp_path,
                                                                  plain_trainer_run, clipping):
    """Left out, gradient_clipping is DeepSpeed's 1.0 for zero.initialize;
    under the Trainer, max_grad_norm alone clips (the engine not again)."""
    ref_state, ref_losses, _ref_norms = plain_trainer_run
    # without the scheduler block, which would replace the Trainer's linear
    # schedule (test_deepspeed_config_scheduler_type_is_honoured)
    dropped = ("scheduler",) if clipping == "written" else ("scheduler", "gradient_clipping")
    config = {k: v for k, v in DEEPSPEED_TEMPLATE.items() if k not in dropped}
    trainer = zero_trainer(tmp_path, {"config": config})
    trainer.train()
    assert trainer.engine.stage == 2 and trainer.engine.lr_scheduler is None
    assert trainer.engine.config.gradient_accumulation_steps == 1  # the Trainer accumulates
    assert trainer.engine.config.gradient_clipping == 0.0  # the Trainer clips
    state = trainer.engine.full_state_dict()
    for ours, ref in zip(logged(trainer, "loss"), ref_losses, strict=True):
        assert same_logged_loss(ours, ref)
    for key, ref in ref_state.items():
        assert max_rel_error(state[key], ref) <= 1e-5, key
    trainer.engine.close()


def test_a_config_optimizer_block_decays_every_parameter_as_under_deepspeed(one_process,
                                                                          tmp_path):
    """HuggingFace's DeepSpeed integration builds a config's optimizer
    over every trainable parameter in one group (transformers'
    deepspeed_optim_sched: DummyOptim(params=model_parameters)), so
    weight_decay reaches the norms and biases the Trainer's own optimizer
    spares; without the block, the Trainer's groups. A hunt ran both
    against HF + DeepSpeed 0.19.8: with weight_decay 0.1, 20 of 21 final
    parameters differed before."""
    config = {k: v for k, v in DEEPSPEED_TEMPLATE.items() if k != "scheduler"}
    decays = {}
    for name, cfg in (("block", config), ("no block", {k: v for k, v in config.items()
                                                       if k != "optimizer"})):
        trainer = zero_trainer(tmp_path / name.replace(" ", "_"), {"config": cfg},
                               weight_decay=0.1, max_steps=1)
        trainer.train()
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        decays[name] = {names[id(p)]: group["weight_decay"]
                        for group in trainer.engine.optimizer.param_groups
                        for p in group["params"]}
        trainer.engine.close()
    assert set(decays["block"].values()) == {0.1}
    assert decays["block"].keys() == decays["no block"].keys()
    spared = {n for n, wd in decays["no block"].items() if wd == 0.0}
    assert spared and all("norm" in n or "bias" in n for n in spared), spared


@pytest.mark.parametrize("change, message", [
    ({"gradient_accumulation_steps": 2 * 2}, "gradient_accumulation_steps is 4 but "
                                             "TrainingArguments.gradient_accumulation_steps is 2"),
    ({"gradient_clipping": 1.0}, "TrainingArguments.max_grad_norm is 0.5"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 5e-3}}},
     "warmup_max_lr is 0.005 but TrainingArguments.learning_rate is 0.001"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
     "the config's optimizer block sets values"),
    ({"optimizer": {"type": "SGD", "params": {"lr": "auto"}}},
     "the config's optimizer type is 'SGD' but TrainingArguments.optim is 'adamw_torch"),
    ({"scheduler": {"type": "CyclicLR", "params": {}}},
     "the config's scheduler type 'CyclicLR' is not supported"),
])
def test_deepspeed_config_disagreeing_with_the_trainer_is_refused(one_process, tmp_path,
                                                                  change, message):
    with pytest.raises(ValueError, match=message):
        zero_trainer(tmp_path, {"config": {**DEEPSPEED_TEMPLATE, **change}})


@pytest.mark.parametrize("kind, expected", [
    # DeepSpeed's schedules, from its formula (_schedulers.py): the optimizer
    # starts at warmup_min_lr (0), the i-th scheduler step sets
    # max * gamma(i), gamma = log(i + 1) / log(W) in warm-up (W = 2 steps:
    # 0, 1), then 1 (WarmupLR) or (T - i) / (T - W) (WarmupDecayLR, T = 6).
    # Update u is logged with the rate it used: 0, gamma(0), gamma(1), ...
    # (the Trainer's linear schedule would log 0, 5e-4, 1e-3, 7.5e-4, ...)
    ("WarmupLR", [0.0, 0.0, 1e-3, 1e-3, 1e-3, 1e-3]),
    ("WarmupDecayLR", [0.0, 0.0, 1e-3, 1e-3, 7.5e-4, 5e-4]),
])
def test_deepspeed_config_scheduler_type_is_honoured(one_process, tmp_path, kind, expected):
    """As under HuggingFace's DeepSpeed integration, the config's scheduler
    type sets the schedule ("auto" from TrainingArguments); before, the
    Trainer's linear schedule silently replaced it."""
    params = {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}
    if kind == "WarmupDecayLR":  # DeepSpeed's WarmupLR takes no total_num_steps
        params["total_num_steps"] = "auto"
    config = {**DEEPSPEED_TEMPLATE, "scheduler": {"type": kind, "params": params}}
    trainer = zero_trainer(tmp_path, {"config": config})
    trainer.train()
    rates = logged(trainer, "learning_rate")
    assert rates == pytest.approx(expected, rel=1e-6, abs=1e-12), rates
    trainer.engine.close()


def test_deepspeed_config_auto_warmup_without_warmup_steps(one_process, tmp_path):
    """TrainingArguments' default warmup_steps=0 fills "auto": DeepSpeed's
    schedulers refuse 0 steps (0.19.8) and warm up over at least 2, so the
    template trains as with warmup_steps 1 or 2 (it raised before)."""
    config = {**DEEPSPEED_TEMPLATE, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}
    trainer = zero_trainer(tmp_path, {"config": config}, warmup_steps=0)
    trainer.train()
    assert logged(trainer, "learning_rate") == pytest.approx(
        [0.0, 0.0, 1e-3, 1e-3, 1e-3, 1e-3], rel=1e-6, abs=1e-12)
    trainer.engine.close()


def test_deepspeed_config_scheduler_values_are_honoured(one_process, tmp_path):
    """Values the Trainer does not set (warmup_type) are the config's; the
    learning rate may repeat TrainingArguments'."""
    config = {**DEEPSPEED_TEMPLATE, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": 1e-3, "warmup_num_steps": "auto", "warmup_type": "linear"}}}
    trainer = zero_trainer(tmp_path, {"config": config}, warmup_steps=4)
    trainer.train()
    # linear warm-up over W = 4: gamma(i) = i / 4; update u uses gamma(u - 1)
    assert logged(trainer, "learning_rate") == pytest.approx(
        [0.0, 0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3], rel=1e-6, abs=1e-12)
    trainer.engine.close()


def test_a_config_object_goes_through_the_trainers_checks(one_process, tmp_path):
    """zero.Config fields the Trainer owns: refused when they disagree with
    TrainingArguments, left to the Trainer when they agree (before, the
    engine accumulated on top of the Trainer: 3 updates for 6 steps)."""
    import zero
    with pytest.raises(ValueError, match="gradient_accumulation_steps is 4 but"):
        zero_trainer(tmp_path, {"config": zero.Config(stage=2, gradient_accumulation_steps=4)})
    # None: derived from train_batch_size, as "auto"
    zero_trainer(tmp_path, {"config": zero.Config(stage=2, gradient_accumulation_steps=None,
                                                  train_batch_size=8)})
    trainer = zero_trainer(tmp_path, {"config": zero.Config(stage=2, gradient_accumulation_steps=2,
                                                            gradient_clipping=0.5)})
    trainer.train()
    assert trainer.engine.config.gradient_accumulation_steps == 1
    assert trainer.engine.config.gradient_clipping == 0.0  # the Trainer clips through it
    assert trainer.engine.global_steps == 6
    trainer.engine.close()


@pytest.mark.parametrize("flag", ["bf16_full_eval", "fp16_full_eval"])
def test_full_eval_casts_are_refused(one_process, tmp_path, flag):
    with pytest.raises(ValueError, match=f"TrainingArguments.{flag} casts the model"):
        zero_trainer(tmp_path, {"stage": 2}, **{flag: True})


@pytest.mark.parametrize("setting", [("torch_compile", True), ("fsdp", "full_shard"),
                                     ("deepspeed", {"zero_optimization": {"stage": 2}})],
                         ids=lambda setting: setting[0])
def test_other_wrappers_of_the_model_are_refused(one_process, tmp_path, setting):
    """The Trainer compiles or wraps the model in accelerate's prepare(),
    which never sees it once the engine wraps it: torch_compile=True
    trained uncompiled without a word. (deepspeed= needs DeepSpeed
    installed to be set at construction: set here afterwards.)"""
    from zero.integrations.hf import ZeroTrainer
    name, value = setting
    args = training_args(tmp_path, **({} if name == "deepspeed" else {name: value}))
    if name == "deepspeed":
        args.deepspeed = value
    with pytest.raises(ValueError, match=f"TrainingArguments.{name}: "):
        ZeroTrainer(model=llama(), args=args, train_dataset=token_data(),
                    zero_options={"stage": 2})
    with pytest.raises(ValueError, match=f"TrainingArguments.{name}: "):  # positional args
        ZeroTrainer(llama(), args, train_dataset=token_data(), zero_options={"stage": 2})


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
def test_accelerate_set_up_for_another_wrapper_is_refused(one_process, tmp_path, monkeypatch,
                                                          variable):
    """An accelerate config (or an earlier TrainingArguments(fsdp=...) in
    this process, a notebook's earlier cell) set accelerate up for FSDP:
    the Trainer failed inside accelerate's FSDP set-up, past zero's checks."""
    from zero.integrations.hf import ZeroTrainer
    args = training_args(tmp_path)  # (transformers refuses DeepSpeed's without it installed)
    monkeypatch.setenv(variable, "true")
    with pytest.raises(ValueError, match=f"{variable}=true in the environment"):
        ZeroTrainer(model=llama(), args=args, train_dataset=token_data(),
                    zero_options={"stage": 3})


def test_a_refused_fsdp_says_what_it_exported_and_the_advice_then_trains(one_process,
                                                                         tmp_path):
    """The refusal's advice followed in the same process (a notebook).
    transformers 4.57's TrainingArguments(fsdp=...) exports
    ACCELERATE_USE_FSDP, which the refusal then names; 5.x's does not."""
    import os
    from zero.integrations.hf import ZeroTrainer
    args = training_args(tmp_path, fsdp="full_shard")
    exported = "ACCELERATE_USE_FSDP" in os.environ
    with pytest.raises(ValueError, match="TrainingArguments.fsdp: ") as refused:
        ZeroTrainer(model=llama(), args=args, train_dataset=token_data(),
                    zero_options={"stage": 2})
    assert ("del os.environ['ACCELERATE_USE_FSDP']" in str(refused.value)) == exported
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    trainer = ZeroTrainer(model=llama(), args=training_args(tmp_path), train_dataset=token_data(),
                          zero_options={"stage": 3})
    trainer.train()
    assert trainer.state.global_step > 0
    trainer.engine.close()


def test_model_init_trains_again_with_a_new_engine(one_process, tmp_path):
    """Trainer.train with model_init makes a new model each time (a
    hyperparameter search, a notebook re-run): each gets its own engine."""
    from zero.integrations.hf import ZeroTrainer
    trainer = ZeroTrainer(model_init=lambda: llama(), args=training_args(tmp_path),
                          train_dataset=token_data(), zero_options={"stage": 3})
    trainer.train()
    first, first_engine = logged(trainer, "loss"), trainer.engine
    trainer.state.log_history = []
    trainer.train()
    assert first_engine._closed and trainer.engine.module is trainer.model
    assert logged(trainer, "loss") == first
    trainer.engine.close()


def test_save_model_after_close_saves_the_plain_model(one_process, tmp_path):
    """A closed stage-3 engine's model is a plain model again: save_model
    writes it (before, it raised and emptied a parameter on each try)."""
    from transformers import LlamaForCausalLM
    trainer = zero_trainer(tmp_path, {"stage": 3})
    trainer.train()
    expected = trainer.engine.full_state_dict()
    trainer.engine.close()
    with pytest.raises(RuntimeError, match="this engine was closed"):
        trainer.engine.full_state_dict()
    trainer.save_model(str(tmp_path / "saved"))
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved")).state_dict()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


def test_fp16_overflow_leaves_the_lr_schedule_alone(one_process, tmp_path):
    """A loss scale of 2^24 overflows fp16 gradients: the engine skips those
    steps, halving the scale, and the Trainer's scheduler must not advance
    on them (as under DeepSpeed)."""
    trainer = zero_trainer(tmp_path, {"stage": 2, "precision": "fp16",
                                      "loss_scaling": {"initial_scale_power": 24,
                                                       "hysteresis": 1}},
                           max_steps=10)
    try:
        trainer.train()
        engine = trainer.engine
        skipped = 10 - engine.global_steps
        assert 0 < skipped < 10
        assert trainer.lr_scheduler.last_epoch == engine.global_steps
    finally:
        if trainer.engine is not None:
            trainer.engine.close()


def test_checkpoint_folder_resumes_exactly_at_another_stage(one_process, tmp_path):
    """bf16 at stage 3, a checkpoint folder every 3 steps; a new trainer at
    stage 1 resumes from checkpoint-3 and ends where the first run ends.
    The folder's model loads with from_pretrained: the fp32 masters."""
    from transformers import LlamaForCausalLM
    from zero.checkpoint import consolidate
    first = zero_trainer(tmp_path / "a", {"stage": 3, "precision": "bf16"},
                         save_strategy="steps", save_steps=3)
    first.train()
    expected = first.engine.full_state_dict()
    first.engine.close()
    folder = tmp_path / "a" / "checkpoint-3"
    assert {"model.safetensors", "zero_checkpoint", "scheduler.pt",
            "trainer_state.json"} <= set(os.listdir(folder))
    saved = consolidate(folder / "zero_checkpoint")["model"]
    loaded = LlamaForCausalLM.from_pretrained(folder).state_dict()
    for key, value in loaded.items():
        assert value.dtype == torch.float32 and torch.equal(value, saved[key]), key

    second = zero_trainer(tmp_path / "b", {"stage": 1, "precision": "bf16"}, seed=7)
    second.train(resume_from_checkpoint=str(folder))
    assert second.state.global_step == 6
    state = second.engine.full_state_dict()
    second.engine.close()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_refuses_settings_the_trainer_owns(one_process, tmp_path):
    with pytest.raises(ValueError, match=r"zero_options\['gradient_accumulation_steps'\]: "
                                         r"the Trainer owns this; set args.gradient_acc"):
        zero_trainer(tmp_path, {"stage": 2, "gradient_accumulation_steps": 4})
    with pytest.raises(ValueError, match="set zero_options=\\{'precision': 'bf16'\\}"):
        zero_trainer(tmp_path, {"stage": 2}, bf16=True)
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"  # restored by one_process
    with pytest.raises(ValueError, match="accelerate runs this Trainer under bf16 autocast"):
        zero_trainer(tmp_path, {"stage": 2})


def test_resuming_a_folder_without_engine_state_is_refused(one_process, tmp_path):
    from transformers import Trainer
    plain = Trainer(model=llama(), args=training_args(tmp_path / "plain", save_strategy="steps",
                                                      save_steps=3), train_dataset=token_data())
    plain.train()
    trainer = zero_trainer(tmp_path / "z", {"stage": 2})
    with pytest.raises(FileNotFoundError, match="has no zero_checkpoint/, so it holds no engine "
                                                "state to resume: it was saved with "
                                                "save_only_model=True"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-3"))
    trainer.engine.close()


def test_label_smoothing_matches_the_plain_trainer(one_process, tmp_path):
    """The Trainer shifts a causal LM's labels for label smoothing when the
    unwrapped model says it is one: the engine unwraps to the model."""
    from transformers import Trainer
    plain = Trainer(model=llama(), train_dataset=token_data(),
                    args=training_args(tmp_path / "p", max_steps=2, label_smoothing_factor=0.1))
    plain.train()
    trainer = zero_trainer(tmp_path / "z", {"stage": 2}, max_steps=2, label_smoothing_factor=0.1)
    trainer.train()
    for ours, ref in zip(logged(trainer, "loss"), logged(plain, "loss"), strict=True):
        assert same_logged_loss(ours, ref)
    trainer.engine.close()


def test_load_best_model_at_end_loads_the_best_folder(one_process, tmp_path):
    """Stage 3 (every unit released): the engine ends on the best folder's
    weights, which are not the last ones, and saves those."""
    from zero.checkpoint import consolidate
    trainer = zero_trainer(tmp_path, {"stage": 3, "stage3_param_persistence_threshold": 0},
                           max_steps=4, learning_rate=3e-2, eval_strategy="steps",
                           eval_steps=1, save_strategy="steps", save_steps=1,
                           load_best_model_at_end=True, metric_for_best_model="eval_loss",
                           eval_dataset=token_data(count=8, seed=3))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-4")
    expected = consolidate(os.path.join(best, "zero_checkpoint"))["model"]
    state = trainer.engine.full_state_dict()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    trainer.save_model(tmp_path / "final")
    from transformers import LlamaForCausalLM
    saved = LlamaForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    assert all(torch.equal(saved[k], expected[k]) for k in saved)
    trainer.engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_after_close_the_trainer_evaluates_and_trains_again(one_process, tmp_path, stage):
    """After trainer.engine.close() the model is a plain torch model: the
    Trainer evaluated through the closed engine (refused), and a second
    train() handed initialize accelerate's wrapper of the engine's
    stand-in optimizer (refused). Now evaluate and predict run on the
    model, with the loss before the close, and train() makes a new engine
    on the real optimizer, which close() gave the states back to."""
    trainer = zero_trainer(tmp_path, {"stage": stage}, eval_dataset=token_data(8, seed=3),
                           max_steps=3)
    trainer.train()
    before = trainer.evaluate()["eval_loss"]
    real = trainer.engine.optimizer
    trainer.engine.close()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(before, rel=1e-6)
    assert trainer.predict(token_data(8, seed=3)).metrics["test_loss"] == \
        pytest.approx(before, rel=1e-6)
    trainer.train()
    assert trainer.engine.optimizer is real and not trainer.engine._closed
    assert len(logged(trainer, "loss")) == 3  # the second run's own log
    trainer.engine.close()


@pytest.mark.parametrize("options, error, message", [
    ("stage3", TypeError, "zero_options must be a dict"),
    (3, TypeError, "zero_options must be a dict"),
    ({"config": {"optimizer": "AdamW"}}, ValueError, "the config's optimizer must be a block"),
    ({"config": {"scheduler": {"type": "WarmupLR", "params": "x"}}}, ValueError,
     "the config's scheduler must be a block")])
def test_malformed_zero_options_are_refused_by_name(one_process, tmp_path, options, error,
                                                    message):
    """Before: "dictionary update sequence element #0 has length 1", an int
    not iterable, a str with no attribute 'get'."""
    with pytest.raises(error, match=message):
        zero_trainer(tmp_path, options)

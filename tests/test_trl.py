"""TRL 1.16's DPO, KTO, GRPO and RLOO trainers on zero (zero.integrations.trl) against
TRL's own run of the same trainer, seed and data, in one process: a tiny
GPT-2 built from a config, a word-level tokenizer built in the test,
preference pairs (DPO), labelled completions (KTO) and prompts with a
reward function (GRPO, RLOO) made here. The logged losses (and GRPO's rewards, which depend on every
sampled token) agree within 1e-5 and every weight within 1e-5 (measured:
the same logs, weights within 5e-7: the engine's C AdamW rounds
differently from torch's). At stage 3 the DPO reference runs under
zero.inference (KTO's too) and GRPO's and RLOO's generations go through
the engine's generate (gathered once per generation)."""
import copy

import pytest
import torch

import zero
from engine_cases import no_launcher

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402  (trl's dependency)
from zero.integrations.trl import (ZeroDPOTrainer, ZeroGRPOTrainer,  # noqa: E402
                                   ZeroKTOTrainer, ZeroRLOOTrainer)


@pytest.fixture(autouse=True)
def _one_process(monkeypatch, tmp_path):
    no_launcher(monkeypatch)
    monkeypatch.chdir(tmp_path)


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i + 2 for i in range(14)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    made = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")
    made.padding_side = "left"
    return made


def policy():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=16, pad_token_id=0, eos_token_id=1,
                                      bos_token_id=1))


def words(g, n):
    return " ".join(f"t{int(i)}" for i in torch.randint(0, 14, (n,), generator=g))


def common(tmp):
    return dict(output_dir=str(tmp), learning_rate=1e-3, logging_steps=1, report_to=[],
                save_strategy="no", use_cpu=True, seed=0, data_seed=0, bf16=False)


def finish(trainer, engine_state):
    trainer.train()
    logs = [{k: h[k] for k in ("loss", "reward", "kl") if k in h}
            for h in trainer.state.log_history if "loss" in h]
    return logs, {k: v.detach().clone() for k, v in engine_state().items()}


def zero_options(stage) -> dict:
    """"3r": stage 3 with every unit released, the LM head too (with TRL's
    fused head it is read outside its module: [Note: TRL's fused head] in
    zero/integrations/_trl_gather.py)."""
    if stage == "3r":
        return {"stage": 3, "stage3_param_persistence_threshold": 0}
    return {"stage": stage}


def dpo(tmp, stage=None):
    g = torch.Generator().manual_seed(0)
    pairs = Dataset.from_list([{"prompt": words(g, 3), "chosen": " " + words(g, 2) + " t0",
                                "rejected": " " + words(g, 3)} for _ in range(32)])
    model = policy()
    args = trl.DPOConfig(per_device_train_batch_size=4, max_steps=5, **common(tmp))
    kwargs = dict(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=pairs,
                  processing_class=tokenizer())
    if stage is None:
        trainer = trl.DPOTrainer(**kwargs)
        return finish(trainer, model.state_dict)
    trainer = ZeroDPOTrainer(**kwargs, zero_options=zero_options(stage))
    if stage in (3, "3r"):  # the reference partitioned like the policy, frozen
        assert isinstance(trainer.ref_model, zero.Engine) and trainer.ref_model.inference_only
    return finish(trainer, lambda: trainer.engine.full_state_dict())


def kto(tmp, stage=None):
    g = torch.Generator().manual_seed(0)
    rows = Dataset.from_list([{"prompt": words(g, 3), "completion": " " + words(g, 2),
                               "label": bool(i % 2)} for i in range(32)])
    model = policy()
    args = trl.KTOConfig(per_device_train_batch_size=4, max_steps=5, **common(tmp))
    kwargs = dict(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=rows,
                  processing_class=tokenizer())
    if stage is None:
        return finish(trl.KTOTrainer(**kwargs), model.state_dict)
    trainer = ZeroKTOTrainer(**kwargs, zero_options=zero_options(stage))
    if stage in (3, "3r"):
        assert isinstance(trainer.ref_model, zero.Engine) and trainer.ref_model.inference_only
    return finish(trainer, lambda: trainer.engine.full_state_dict())


def reward(completions, **_kwargs):
    return [float(sum(w in ("t0", "t1", "t2", "t3", "t4", "t5", "t6") for w in c.split()))
            for c in completions]


SAMPLERS = {"grpo": (trl.GRPOConfig, trl.GRPOTrainer, ZeroGRPOTrainer),
            "rloo": (trl.RLOOConfig, trl.RLOOTrainer, ZeroRLOOTrainer)}


def grpo(tmp, stage=None, calls=None, trainers=None, kind="grpo", beta=0.0):
    config, theirs, ours = SAMPLERS[kind]
    g = torch.Generator().manual_seed(0)
    prompts = Dataset.from_list([{"prompt": words(g, 3)} for _ in range(32)])
    model = policy()
    if beta:  # TRL loads the reference (and then the policy) from a path
        model.save_pretrained(tmp / "policy")
        model = str(tmp / "policy")
    args = config(per_device_train_batch_size=8, num_generations=4, beta=beta,
                  max_completion_length=4, max_steps=3, **common(tmp))
    kwargs = dict(model=model, reward_funcs=reward, args=args, train_dataset=prompts,
                  processing_class=tokenizer())
    if stage is None:
        trainer = theirs(**kwargs)
        return finish(trainer, trainer.model.state_dict)
    trainer = ours(**kwargs, zero_options=zero_options(stage))
    if beta and stage in (3, "3r"):  # the reference partitioned like the policy, frozen
        assert isinstance(trainer.ref_model, zero.Engine) and trainer.ref_model.inference_only
    if trainers is not None:
        trainers.append(trainer)
    if calls is not None:  # the route's calls into the engine's generate
        from zero.engine import _generation
        generate = _generation.generate

        def counted(*a, **k):
            calls.append(1)
            return generate(*a, **k)
        _generation.generate = counted
        try:
            return finish(trainer, lambda: trainer.engine.full_state_dict())
        finally:
            _generation.generate = generate
    return finish(trainer, lambda: trainer.engine.full_state_dict())


def same(ours, theirs):
    (logs, state), (ref_logs, ref_state) = ours, theirs
    assert len(logs) == len(ref_logs) > 0
    for got, expected in zip(logs, ref_logs):
        for key, value in expected.items():
            assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, logs, ref_logs)
    assert set(state) >= set(ref_state) - {"lm_head.weight"}
    for name, value in ref_state.items():
        if name in state:
            assert (state[name] - value).abs().max() <= 1e-5, name


@pytest.mark.parametrize("stage", [2, 3, "3r"])
def test_dpo_on_zero_is_trls(tmp_path, stage):
    same(dpo(tmp_path / "zero", stage), dpo(tmp_path / "trl"))


@pytest.mark.parametrize("stage", [2, 3, "3r"])
def test_kto_on_zero_is_trls(tmp_path, stage):
    same(kto(tmp_path / "zero", stage), kto(tmp_path / "trl"))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_sampling_trainers_on_zero_are_trls(tmp_path, stage, kind):
    calls, trainers = [], []
    same(grpo(tmp_path / "zero", stage, calls, trainers, kind), grpo(tmp_path / "trl", kind=kind))
    # stage 3 generates through the engine (gathered once), 2 through the module
    assert (len(calls) > 0) == (stage == 3)
    assert "generate" not in trainers[0].engine.module.__dict__  # the class's generate


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_sampling_trainers_with_a_kl_term_on_zero_are_trls(tmp_path, kind):
    """beta > 0: a reference model, under zero.inference at stage 3."""
    ours, theirs = (grpo(tmp_path / "zero", 3, kind=kind, beta=0.1),
                    grpo(tmp_path / "trl", kind=kind, beta=0.1))
    same(ours, theirs)
    assert any(log.get("kl", 0) > 0 for log in theirs[0])  # the term is there


def test_grpo_with_every_unit_released_is_trls(tmp_path):
    """The fused LM head reads a released weight at stage 3 ([Note: TRL's
    fused head]): gathered for it, the run is TRL's own."""
    same(grpo(tmp_path / "zero", "3r"), grpo(tmp_path / "trl"))


@pytest.mark.parametrize("how", ["dict", "path", "Config", "keyword over config"])
def test_the_reference_follows_the_stage_a_config_gives(tmp_path, how):
    """Stage 3 given in zero_options' config (a DeepSpeed dict or JSON path,
    or a zero.Config) puts the reference under zero.inference with the
    precision and persistence the engine reads from it, as zero.initialize
    reads them (the engine built here is the reference of the check); a
    top-level stage overrides the config's, as in zero.initialize. Before,
    only a top-level "stage": 3 was read: the reference stayed whole."""
    import json
    ds = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "bf16": {"enabled": True}}
    if how == "path":
        (tmp_path / "ds.json").write_text(json.dumps(ds))
    config = {"dict": ds, "path": str(tmp_path / "ds.json"), "keyword over config": ds,
              "Config": zero.Config(stage=3, precision="bf16",
                                    stage3_param_persistence_threshold=0)}[how]
    options = {"config": config, **({"stage": 2} if how == "keyword over config" else {})}
    g = torch.Generator().manual_seed(0)
    pairs = Dataset.from_list([{"prompt": words(g, 3), "chosen": " " + words(g, 2),
                                "rejected": " " + words(g, 3)} for _ in range(4)])
    model = policy()
    trainer = ZeroDPOTrainer(model=model, ref_model=copy.deepcopy(model),
                             args=trl.DPOConfig(per_device_train_batch_size=4, max_steps=1,
                                                **common(tmp_path)),
                             train_dataset=pairs, processing_class=tokenizer(),
                             zero_options=options)
    trainer.create_optimizer()  # the engine, as zero.initialize makes it of the options
    engine, reference = trainer.engine, trainer.ref_model
    assert engine.config.precision == "bf16"
    if how == "keyword over config":
        assert engine.config.stage == 2 and not isinstance(reference, zero.Engine)
    else:
        assert engine.config.stage == 3
        assert isinstance(reference, zero.Engine) and reference.inference_only
        for name in ("stage", "precision", "stage3_param_persistence_threshold",
                     "offload_param"):
            assert getattr(reference.config, name) == getattr(engine.config, name), name
        reference.close()
    engine.close()

"""zero.deepspeed: DeepSpeed's training-script API on zero's engine.

The main check runs tests/deepspeed_script.py, written with DeepSpeed's
API only, with its import line changed to `import zero.deepspeed as
deepspeed`, on 1 rank (plain python) and 2 (torchrun) at stages 0-3, and
compares with DeepSpeed 0.19.8's own run of the same script, stored in
tests/data/deepspeed_losses.json: every loss (6 steps, then two more after
a save and a load, the second reading the loaded optimizer states; a
WarmupLR schedule), the step count, the gathered weights' norm and the
norm of zero_to_fp32's state dict. fp32; both sides compute the same
forward and backward with torch and differ in the AdamW update's rounding
(DeepSpeed's torch AdamW, zero's fused C update): measured up to 6e-7
relative after 8 steps, so 1e-5 is the bound (an update off by one step,
a wrong clip or a wrong sampler is off by more than 1e-2)."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import zero
import zero.deepspeed as deepspeed
from deepspeed_runs import ROOT, run_script, script_on_zero
from conftest import max_rel_error
from engine_cases import Net, batches, loss_of

REFERENCE = json.loads((ROOT / "tests" / "data" / "deepspeed_losses.json").read_text())


@pytest.fixture(scope="module")
def on_zero(tmp_path_factory):
    """The script with its import line changed, as a user would."""
    return script_on_zero(tmp_path_factory.mktemp("script"))


def close(a, b, tolerance=1e-5):
    return abs(a - b) <= tolerance * max(abs(b), 1e-12)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_deepspeed_script_matches_deepspeed(on_zero, tmp_path, world, stage):
    got = run_script(on_zero, world, tmp_path, "--stage", stage, "--save", tmp_path / "ckpt")
    expected = REFERENCE[f"world{world}-stage{stage}"]
    assert len(got["losses"]) == len(expected["losses"]) == 8
    for step, (ours, theirs) in enumerate(zip(got["losses"], expected["losses"])):
        assert close(ours, theirs), f"step {step}: {ours} against DeepSpeed's {theirs}"
    assert got["global_steps"] == expected["global_steps"]
    assert close(got["weight_norm_squared"], expected["weight_norm_squared"])
    if expected["state_norm_squared"] is not None:
        assert close(got["state_norm_squared"], expected["state_norm_squared"])


# ---- the pieces, in one process -------------------------------------------------

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2}}


def test_initialize_returns_deepspeeds_four(deepspeed_script):
    torch.manual_seed(0)
    model = Net()
    dataset = torch.utils.data.TensorDataset(torch.randint(0, 50, (10, 7)),
                                             torch.randint(0, 50, (10, 7)))
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset,
        config=CONFIG)
    assert isinstance(engine, zero.Engine) and optimizer is engine.optimizer
    assert isinstance(optimizer, torch.optim.AdamW) and scheduler is None
    assert loader.batch_size == 2 and len(loader) == 5
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    # DeepSpeed's name for it, which scripts call set_epoch on each epoch
    # (an AttributeError before: a DeepSpeed hunt)
    assert loader.data_sampler is loader.sampler
    first = [batch[0] for batch in loader]
    loader.data_sampler.set_epoch(1)
    assert not all(torch.equal(a, b) for a, b in zip(first, (batch[0] for batch in loader)))
    assert engine.dp_world_size == 1 and engine.gradient_clipping() == 0.5
    tokens, targets = next(iter(loader))
    engine.backward(loss_of(engine(tokens), targets))
    engine.step()
    assert engine.global_steps == 1
    engine.close()


def test_a_config_without_a_batch_size_is_refused_as_deepspeed_refuses_it(deepspeed_script):
    """Accepted before, the batch-size queries then answering None where
    DeepSpeed asserts one of the two (a DeepSpeed hunt)."""
    for config in ({"gradient_accumulation_steps": 2}, {}):
        with pytest.raises(ValueError, match="the config gives neither train_batch_size nor "
                           "train_micro_batch_size_per_gpu"):
            deepspeed.initialize(model=Net(), config=config)
    # an HF template's "auto" outside the Trainer is named (it was "gives
    # neither", with both given)
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu is 'auto', which "
                                         "HuggingFace's DeepSpeed integration fills in"):
        deepspeed.initialize(model=Net(), config={"train_micro_batch_size_per_gpu": "auto",
                                                  "train_batch_size": "auto"})
    engine, *_ = deepspeed.initialize(model=Net(), config={"train_batch_size": 4})
    assert engine.train_micro_batch_size_per_gpu() == 4
    engine.close()


def test_the_optimizer_may_be_a_factory_over_param_groups(deepspeed_script):
    torch.manual_seed(0)
    model = Net()
    groups = [{"params": model.head.parameters(), "lr": 0.1},
              {"params": [*model.embed.parameters(), *model.body.parameters()]}]
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01), config={
            "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.01]
    engine.close()


@pytest.mark.parametrize("name,decoupled", [("FusedAdam", True), ("FusedAdam", False),
                                            ("DeepSpeedCPUAdam", True)])
def test_deepspeed_chats_adam_trains_as_torchs(deepspeed_script, name, decoupled):
    """`from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam`, as
    DeepSpeed-Chat builds its optimizer (a ModuleNotFoundError before: a
    DeepSpeed hunt): torch's AdamW (adamw mode) or Adam (the decay added to
    the gradient), stepped by the engine as torch steps them (1e-5: the
    engine's fused update is a few ulps off torch's a step)."""
    from zero.deepspeed.ops import adam
    mode = {"FusedAdam": "adam_w_mode", "DeepSpeedCPUAdam": "adamw_mode"}[name]
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    groups = lambda m: [{"params": m.head.parameters(), "weight_decay": 0.0},  # noqa: E731
                        {"params": [*m.embed.parameters(), *m.body.parameters()]}]
    opt = getattr(adam, name)(groups(model), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                              **{mode: decoupled})
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    assert type(opt) is kind
    ref_opt = kind(groups(ref), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "gradient_clipping": 0.0})  # (DeepSpeed's default clips at 1.0)
    for tokens, targets in batches("cpu", 3):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
        loss_of(ref(tokens), targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = engine.full_state_dict()
    for key, p in ref.named_parameters():
        assert max_rel_error(got[key], p) <= 1e-5, key
    engine.close()
    with pytest.raises(ValueError, match=r"FusedAdam\(bias_correction=False\): zero steps"):
        adam.FusedAdam(model.parameters(), bias_correction=False)
    with pytest.raises(ValueError, match=r"DeepSpeedCPUAdam\(amsgrad=True\)"):
        adam.DeepSpeedCPUAdam(model.parameters(), amsgrad=True)
    assert deepspeed.__version__ == "0.19.8"  # the API mirrored, which scripts gate on


def test_the_config_comes_from_args(deepspeed_script, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    parser = deepspeed.add_config_arguments(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(args=args, model=model)
    assert engine.config.gradient_clipping == 0.5
    engine.close()


def test_the_old_deepscale_config_argument_is_read_with_a_warning(deepspeed_script, tmp_path,
                                                                 monkeypatch):
    """DeepSpeed reads --deepscale_config and logs that it is deprecated;
    zero read it without a word."""
    import io
    from zero.deepspeed import utils
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    parser = deepspeed.add_config_arguments(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--deepscale", "--deepscale_config", str(path)])
    import logging
    handler, = [h for h in utils.logger.handlers if isinstance(h, logging.StreamHandler)]
    out = io.StringIO()
    monkeypatch.setattr(handler, "stream", out)
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(args=args, model=Net())
    assert engine.config.gradient_clipping == 0.5
    assert "--deepscale_config is deprecated" in out.getvalue()
    engine.close()


@pytest.mark.parametrize("arguments,error,match", [
    ({}, ValueError, "no DeepSpeed config"),
    ({"config": CONFIG, "config_params": CONFIG}, ValueError, "not both"),
    ({"config": CONFIG, "mpu": object()}, ValueError, "mpu: it has none of "
     "get_data_parallel_group"),
    ({"config": CONFIG, "mesh_param": (2, 2)}, NotImplementedError, "mesh_param"),
])
def test_refusals_say_what_deepspeed_does(deepspeed_script, arguments, error, match):
    with pytest.raises(error, match=match):
        deepspeed.initialize(model=Net(), **arguments)
    with pytest.raises(ValueError, match="model is None"):
        deepspeed.initialize(config=CONFIG)


def test_zero_init_builds_partitioned_or_whole(deepspeed_script):
    with deepspeed.zero.Init(enabled=False):
        whole = nn.Linear(4, 4)
    assert whole.weight.numel() == 16
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        model = Net()
    engine, *_ = deepspeed.initialize(model=model, config={**CONFIG, "zero_optimization": {
        "stage": 3}})
    with deepspeed.zero.GatheredParameters([model.head.weight], modifier_rank=0):
        assert model.head.weight.shape == (50, 16)
    engine.empty_partition_cache()
    engine.close()
    with pytest.raises(NotImplementedError, match="module=.*build it inside"):
        deepspeed.zero.Init(module=Net())


def test_zero_to_fp32_reads_zeros_checkpoints(deepspeed_script, tmp_path):
    torch.manual_seed(0)
    model = Net()
    model.embed.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[
        p for p in model.parameters() if p.requires_grad], config=CONFIG)
    for tokens, targets in batches("cpu", 2):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    full = engine.full_state_dict()
    engine.close()
    fp32 = deepspeed.utils.zero_to_fp32
    state = fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert state.keys() == full.keys()
    assert all(torch.equal(state[k], full[k]) for k in full)
    trained = fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt",
                                                            exclude_frozen_parameters=True)
    assert "embed.weight" not in trained and "head.weight" in trained
    fp32.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "bin")
    fp32.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "st",
                                                    safe_serialization=True)
    loaded = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    from safetensors.torch import load_file
    safe = load_file(tmp_path / "st" / "model.safetensors")
    for name, value in full.items():
        assert torch.equal(loaded[name], value) and torch.equal(safe[name], value), name
    fresh = fp32.load_state_dict_from_zero_checkpoint(Net(), tmp_path / "ckpt")
    assert torch.equal(fresh.head.weight.detach(), full["head.weight"])


def test_the_script_save_checkpoint_leaves_writes_the_model(deepspeed_script, tmp_path):
    """DeepSpeed users run <save_dir>/zero_to_fp32.py <save_dir> <out>: the
    one save_checkpoint leaves there writes the checkpoint's fp32 model,
    with DeepSpeed's arguments, and refuses to write into a tag."""
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=CONFIG)
    engine.save_checkpoint(tmp_path / "ckpt", tag="first")
    for tokens, targets in batches("cpu", 2):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt", tag="trained")
    full = engine.full_state_dict()
    engine.close()
    script = tmp_path / "ckpt" / "zero_to_fp32.py"
    assert os.access(script, os.X_OK)

    def run(*args):
        return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    done = run(tmp_path / "ckpt", tmp_path / "out", "--safe_serialization")
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file
    safe = load_file(tmp_path / "out" / "model.safetensors")
    assert safe.keys() == full.keys()
    assert all(torch.equal(safe[k], full[k]) for k in full)
    done = run(tmp_path / "ckpt", tmp_path / "first_out", "-t", "first", "--max_shard_size",
               "1GB")
    assert done.returncode == 0, done.stderr
    first = torch.load(tmp_path / "first_out" / "pytorch_model.bin", weights_only=True)
    assert not torch.equal(first["head.weight"], full["head.weight"])
    refused = run(tmp_path / "ckpt", tmp_path / "ckpt" / "trained")
    assert refused.returncode == 2 and "would overwrite the checkpoint" in refused.stderr
    missing = run(tmp_path / "ckpt", tmp_path / "x", "-t", "third")
    assert missing.returncode == 2 and "third" in missing.stderr


def test_the_accelerator_answers_on_the_cpu():
    acc = deepspeed.accelerator.get_accelerator()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert acc.device_name() == expected and acc.is_available()
    assert acc.communication_backend_name() == ("nccl" if expected == "cuda" else "gloo")
    acc.synchronize()
    assert acc.memory_allocated() >= 0 and acc.device_count() >= 1
    assert acc.total_memory() > 0


def test_checkpointing_recomputes_the_same_gradients():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(3, 8, requires_grad=True)
    deepspeed.checkpointing.checkpoint(layer, x).sum().backward()
    checkpointed = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    deepspeed.checkpointing.non_reentrant_checkpoint(layer, x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(checkpointed, layer.parameters()))
    layer.zero_grad()
    # keyword arguments reach the function, a keyword tensor its gradient too
    shift = torch.randn(8, requires_grad=True)
    deepspeed.checkpointing.checkpoint(lambda h, scale, add: layer(h) * scale + add, x,
                                       scale=2.0, add=shift).sum().backward()
    assert torch.equal(shift.grad, torch.full((8,), 3.0))
    assert all(torch.allclose(2 * a, p.grad) for a, p in zip(checkpointed, layer.parameters()))
    layer.zero_grad()
    layer(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(checkpointed, layer.parameters()))
    deepspeed.checkpointing.configure(None)
    assert deepspeed.checkpointing.is_configured()
    with pytest.raises(NotImplementedError, match="partition_activations"):
        deepspeed.checkpointing.configure(None, partition_activations=True)


def test_checkpointing_takes_megatrons_mpu_and_recomputes_dropout_alike():
    """Megatron-DeepSpeed calls configure(mpu, deepspeed_config=...,
    partition_activations=False, ...): taken; the recomputed dropout masks
    are the forward's (torch keeps the random state)."""
    class Mpu:  # the part of Megatron's mpu a script has; none of it is read
        def get_model_parallel_world_size(self):
            return 2
    deepspeed.checkpointing.configure(Mpu(), deepspeed_config={"train_batch_size": 8},
                                      partition_activations=False, checkpoint_in_cpu=False,
                                      contiguous_checkpointing=False)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(3, 8)
    grads = []
    for run in (lambda: deepspeed.checkpointing.checkpoint(layer, x), lambda: layer(x)):
        torch.manual_seed(5)
        layer.zero_grad()
        run().square().sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ---- config keys --------------------------------------------------------------

def test_a_disabled_block_is_accepted_whatever_it_holds():
    cfg = zero.Config.from_deepspeed({
        "tensorboard": {"enabled": False, "output_path": "runs/", "unknown": "x"},
        "wandb": {"enabled": "false", "project": "p"},
        "flops_profiler": {"enabled": False, "profile_step": 1, "anything": [1, 2]},
        "zero_optimization": {"stage": 1}})
    assert cfg.stage == 1 and cfg.monitor is None


@pytest.mark.parametrize("config,match", [
    ({"tensor_parallel": {"autotp_size": 2}},
     r"tensor_parallel: a DeepSpeed key zero does not support \(DeepSpeed's AutoTP is not"),
    ({"amp": {"enabled": True}}, r"amp: a DeepSpeed key zero does not support \(NVIDIA apex"),
    ({"sparse_gradients": True}, "sparse_gradients: a DeepSpeed key zero does not support"),
    ({"trian_batch_size": 8}, r"trian_batch_size: not a DeepSpeed key \(a typo of "
                              r"'train_batch_size'\?\)"),
    ({"zero_optimization": {"stage": 2, "overlap_comms": True}},
     r"zero_optimization.overlap_comms: not a DeepSpeed key \(a typo of "
     r"'zero_optimization.overlap_comm'\?\)"),
    ({"zero_optimisation": {"stage": 2}}, r"a typo of 'zero_optimization'"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     "ZeRO\\+\\+'s quantized weights are not supported"),
    # DeepSpeed 0.19's, called typos before (a DeepSpeed hunt)
    ({"data_types": {"keep_in_fp32_modules": ["norm"]}},
     "data_types.keep_in_fp32_modules: a DeepSpeed key zero does not support"),
])
def test_a_refused_key_says_whether_it_is_deepspeeds(config, match):
    with pytest.raises(ValueError, match=match):
        zero.Config.from_deepspeed(config)


def test_blocks_with_every_feature_off_are_accepted():
    """What DeepSpeed configs (HuggingFace's templates, DeepSpeedExamples)
    often carry with nothing turned on."""
    cfg = zero.Config.from_deepspeed({
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False,
                                     "number_checkpoints": None,
                                     "synchronize_checkpoint_boundary": False,
                                     "profile": False},
        "checkpoint": {"tag_validation": "Warn", "load_universal": False,
                       "use_node_local_storage": False},
        "communication_data_type": None, "sparse_gradients": False,
        "memory_breakdown": False, "zero_optimization": {"stage": 2}})
    assert cfg.stage == 2
    for turned_on, match in (
            ({"activation_checkpointing": {"partition_activations": True}},
             "activation_checkpointing: a DeepSpeed key zero does not support"),
            ({"checkpoint": {"load_universal": True}}, "universal checkpoints"),
            ({"communication_data_type": "fp32"}, "communication_data_type")):
        with pytest.raises(ValueError, match=match):
            zero.Config.from_deepspeed(turned_on)


def test_cpu_offload_is_read_as_deepspeed_reads_it():
    with pytest.warns(DeprecationWarning, match="cpu_offload is deprecated"):
        cfg = zero.Config.from_deepspeed({"zero_optimization": {"stage": 2,
                                                                "cpu_offload": True}})
    assert cfg.offload_optimizer.device == "cpu"
    with pytest.warns(DeprecationWarning):
        cfg = zero.Config.from_deepspeed({"zero_optimization": {"stage": 2,
                                                                "cpu_offload": False}})
    assert cfg.offload_optimizer.device == "none"
    cfg = zero.Config.from_deepspeed({"zero_optimization": {
        "stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
        "ignore_unused_parameters": True}})
    assert cfg.stage == 3


def test_the_aio_block_sets_zeros_disk_engine(deepspeed_script, tmp_path):
    from zero.offload._aio import io_info, set_io
    cfg = zero.Config.from_deepspeed({
        "aio": {"block_size": 262144, "queue_depth": 8, "thread_count": 1,
                "single_submit": False, "overlap_events": True, "use_gds": False},
        "zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path)}}})
    assert cfg.aio == {"block_size": 262144, "queue_depth": 8}
    previous = io_info()
    try:
        torch.manual_seed(0)
        model = Net()
        engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                                 config=cfg)
        assert io_info()["block_size"] == 262144 and io_info()["queue_depth"] == 8
        tokens, targets = batches("cpu", 1)[0]
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()  # through the disk engine with those settings
        engine.close()
    finally:
        set_io(queue_depth=previous["queue_depth"], block_size=previous["block_size"])
    for bad, match in (({"block_size": 0}, "aio.block_size must be an integer from 1 to 2"),
                       ({"use_gds": True}, "GPUDirect Storage is not supported"),
                       ({"queue_dept": 8}, "aio.queue_dept: not a DeepSpeed key")):
        with pytest.raises(ValueError, match=match):
            zero.Config.from_deepspeed({"aio": bad})


@pytest.mark.parametrize("key, value", [
    ("hybrid_engine", {"enabled": True}), ("compile", {"deepcompile": True}),
    ("gradient_allreduce_op", "sum"), ("managed_gradient_accumulation", True),
    ("graph_harvesting", True), ("weight_quantization", {"post_init_quant": {}}),
    ("eigenvalue", {"enabled": True}), ("progressive_layer_drop", {"enabled": True}),
    ("expert_parallel", {"expert_parallel_size": 2}),
    ("use_data_before_expert_parallelism", True),
    ("seq_parallel_communication_data_type", "fp32"), ("torch_autocast", {"enabled": True})])
def test_more_of_deepspeeds_keys_are_named_as_deepspeeds(key, value):
    """DeepSpeed 0.19.8's own top-level keys are never called typos."""
    with pytest.raises(ValueError, match=f"{key}: a DeepSpeed key zero does not support"):
        zero.Config.from_deepspeed({key: value})


def test_deepspeeds_logging_keys_and_bfloat16_are_read():
    cfg = zero.Config.from_deepspeed({"log_level": "info", "timers": {"throughput": {}},
                                      "disable_python_gc": 100, "disable_allgather": False,
                                      "bfloat16": {"enabled": True}})
    assert cfg.precision == "bf16"
    with pytest.raises(ValueError, match="both bf16 and bfloat16"):
        zero.Config.from_deepspeed({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})


def test_dataloader_drop_last(deepspeed_script):
    dataset = torch.utils.data.TensorDataset(torch.randint(0, 50, (11, 7)),
                                             torch.randint(0, 50, (11, 7)))
    for drop, batches_seen in ((False, 6), (True, 5)):
        torch.manual_seed(0)
        model = Net()
        engine, _, loader, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), training_data=dataset,
            config={**CONFIG, "dataloader_drop_last": drop})
        assert len(loader) == batches_seen and loader.drop_last is drop
        engine.close()
    with pytest.raises(ValueError, match="dataloader_drop_last must be true or false"):
        zero.Config.from_deepspeed({"dataloader_drop_last": "yes"})


def test_init_distributed_takes_deepspeeds_timeout_from_the_environment(deepspeed_script,
                                                                        monkeypatch):
    import datetime
    import torch.distributed as dist
    from zero.comm._comm import group_timeout
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "7")
    deepspeed.init_distributed(dist_backend="gloo")
    assert group_timeout() == datetime.timedelta(minutes=7)
    dist.destroy_process_group()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=90))
    assert group_timeout() == datetime.timedelta(seconds=90)  # given: the environment's unread
    dist.destroy_process_group()
    for bad in ("ten", "0"):
        monkeypatch.setenv("DEEPSPEED_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"DEEPSPEED_TIMEOUT .*{bad!r}"):
            deepspeed.init_distributed(dist_backend="gloo")
    assert not dist.is_initialized()


def dschat_train_config(stage):
    """DeepSpeed-Chat's get_train_ds_config (dschat/utils/ds_utils.py), as
    its step-3 actor writes it."""
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
            "zero_optimization": {"stage": stage, "overlap_comm": True,
                                  "offload_param": {"device": "none"},
                                  "offload_optimizer": {"device": "none"},
                                  "stage3_param_persistence_threshold": 1e4,
                                  "stage3_max_live_parameters": 3e7,
                                  "stage3_prefetch_bucket_size": 3e7,
                                  "memory_efficient_linear": False},
            "bf16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False,
            "wall_clock_breakdown": False,
            "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                              "release_inference_cache": False, "pin_parameters": True,
                              "tp_gather_partition_size": 8},
            "tensorboard": {"enabled": False, "output_path": "logs/", "job_name": "actor"}}


def test_deepspeed_chats_configs_are_read():
    cfg = zero.Config.from_deepspeed(dschat_train_config(3))
    assert (cfg.stage, cfg.precision, cfg.stage3_param_persistence_threshold) == \
        (3, "bf16", 10_000)


# every other key of DeepSpeed 0.19.8's zero_optimization block (its
# DeepSpeedZeroConfig), at a value a config writes
@pytest.mark.parametrize("key, value", [
    ("memory_efficient_linear", True), ("override_module_apply", True),
    ("log_trace_cache_warnings", False), ("enable_sanity_checks", True),
    ("legacy_stage1", False), ("use_multi_rank_bucket_allreduce", True),
    ("stage3_module_granularity_threshold", 1000),
    ("stage3_use_all_reduce_for_fetch_params", True), ("stage3_allgather_sequential", True),
    ("stage3_partition_stream_chunk_size", 0), ("pipeline_loading_checkpoint", False),
    ("save_muon_momentum_buffer_in_memory", False),
    # ZeRO++, MiCS, ZenFlow and leaf modules at their off values
    ("zero_hpz_partition_size", 1), ("zero_quantized_weights", False),
    ("zero_quantized_gradients", False), ("zero_quantized_nontrainable_weights", False),
    ("mics_shard_size", -1), ("mics_hierarchical_params_gather", False),
    ("zeropp_loco_param", None), ("zenflow", None),
    ("leaf_module", {"classes": [], "names": [], "name_suffixes": []})])
def test_deepspeeds_zero_keys_are_accepted(key, value):
    cfg = zero.Config.from_deepspeed({"zero_optimization": {"stage": 3, key: value}})
    assert cfg.stage == 3


@pytest.mark.parametrize("key, value, why", [
    ("zero_quantized_nontrainable_weights", True, "quantized weights"),
    ("zero_quantized_weights", True, "quantized weights"),
    ("zero_hpz_partition_size", 8, "mesh"), ("mics_shard_size", 8, "mesh"),
    ("mics_hierarchical_params_gather", True, "mesh"),
    ("zeropp_loco_param", {"err_beta": 0.8, "reset_T": 1024}, "quantized gradients"),
    ("zenflow", {"topk_ratio": 0.1}, "delayed_update"),
    ("leaf_module", {"classes": ["MixtralSparseMoeBlock"]}, "set_z3_leaf_modules")])
def test_deepspeeds_zero_features_turned_on_are_refused_by_name(key, value, why):
    with pytest.raises(ValueError, match=f"zero_optimization.{key}: a DeepSpeed key zero "
                                         f"does not support \\(.*{why}"):
        zero.Config.from_deepspeed({"zero_optimization": {"stage": 3, key: value}})


def test_model_persistence_threshold_is_read():
    read = lambda v: zero.Config.from_deepspeed(  # noqa: E731
        {"zero_optimization": {"stage": 3, "stage3_model_persistence_threshold": v}})
    assert read(1e6).stage3_model_persistence_threshold == 10**6
    assert zero.Config().stage3_model_persistence_threshold is None
    with pytest.raises(ValueError, match="stage3_model_persistence_threshold must be an "
                                         "integer >= 0"):
        zero.initialize(Net(), stage=3, stage3_model_persistence_threshold=-5)


def test_set_z3_leaf_modules_marks_what_stage3_gathers_whole():
    """deepspeed.utils.set_z3_leaf_modules (HuggingFace's Mixtral code and
    MoE recipes call it before initialize): the marked modules are leaf
    units, as with stage3_leaf_modules; unset takes the mark off."""
    from zero.deepspeed.utils import (get_z3_leaf_modules, set_z3_leaf_modules,
                                      unset_z3_leaf_modules, z3_leaf_module)

    def units_of(model, **options):
        engine = zero.initialize(model, stage=3, **options)
        roots = engine._unit_roots
        found = [(name, roots.is_leaf(m)) for name, m in model.named_modules()
                 if roots.root(m) is m]
        engine.close()
        return found

    torch.manual_seed(0)
    marked = Net()
    assert set_z3_leaf_modules(marked, [nn.Sequential]) == [marked.body]
    assert z3_leaf_module(marked.body) and get_z3_leaf_modules(marked) == [marked.body]
    named = Net()
    expected = units_of(named, stage3_leaf_modules=["Sequential"], units="module")
    assert ("body", True) in expected
    assert units_of(marked, units="module") == expected
    assert unset_z3_leaf_modules(marked, ["Sequential"]) == [marked.body]
    assert not z3_leaf_module(marked.body)
    with pytest.raises(ValueError, match="no module of the model is one of"):
        set_z3_leaf_modules(Net(), [nn.Conv2d])
    with pytest.raises(TypeError, match="leaf_module_classes must be"):
        set_z3_leaf_modules(Net(), [])


def test_a_model_partitioned_by_deepspeeds_own_init_is_refused_by_name(deepspeed_script):
    """transformers' HfDeepSpeedConfig with deepspeed installed builds the
    model under DeepSpeed's zero.Init: empty parameters whose values sit in
    DeepSpeed's ds_tensor. It failed in the forward ("'weight' must be
    2-D"); refused at initialize, naming the way out (a DeepSpeed hunt,
    with deepspeed 0.19.8's own model). Made here as DeepSpeed leaves it."""
    model = Net()
    weight = model.head.weight
    weight.ds_tensor = weight.data.flatten()[:8].clone()
    weight.ds_shape = weight.shape
    weight.data = torch.empty(0)
    with pytest.raises(ValueError, match="parameter 'head.weight' was partitioned by "
                                         "DeepSpeed's own zero.Init .*HfDeepSpeedConfig"):
        deepspeed.initialize(model=model, config=CONFIG)

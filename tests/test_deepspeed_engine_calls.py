"""The DeepSpeed engine calls a script moved over by its import line makes
beyond initialize, backward and step (engine/_deepspeed_queries.py,
engine/_checkpoint_calls.py): DeepSpeed's names and argument orders, with
DeepSpeed 0.19.8's values (read from its source and runs on this
machine's CPU, stop 31)."""
import pytest
import torch
from torch import nn

import zero.deepspeed as deepspeed


def engine_for(stage=1, accumulation=1, optimizer=None, fp16=False):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": accumulation,
              "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}}
    if fp16:
        config["fp16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return engine, model


def test_queries_and_aliases(deepspeed_script, tmp_path):
    engine, _model = engine_for(stage=2)
    assert engine.get_mom() == [(0.9, 0.999)]
    assert engine.zero_optimization_partition_gradients() is True
    assert engine.zero_optimization_partition_weights() is False
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    assert engine.loss_scale() == engine.loss_scale == 1.0  # method and number alike
    full = engine.full_state_dict()
    got = engine.module_state_dict(prefix="m.")
    assert sorted(got) == ["m.bias", "m.weight"]
    assert torch.equal(got["m.weight"], full["weight"])
    assert engine.save_fp16_model(tmp_path, "model.bin") is True
    assert torch.equal(torch.load(tmp_path / "model.bin")["weight"], full["weight"])
    engine.destroy()
    with pytest.raises(RuntimeError, match="this engine was closed"):
        engine.step()
    sgd, _ = engine_for(stage=3, optimizer={"type": "SGD", "params": {"lr": 0.1,
                                                                     "momentum": 0.5}})
    assert sgd.get_mom() == [0.5]
    assert sgd.zero_optimization_partition_weights() is True
    sgd.close()


def test_fp16_loss_scale_is_callable_and_a_number(deepspeed_script):
    engine, _ = engine_for(fp16=True)
    assert engine.loss_scale() == float(engine.loss_scale) == 2.0 ** 16
    assert engine.loss_scale * 2 == 2.0 ** 17
    engine.close()


def test_set_gradient_accumulation_boundary_decides_the_update(deepspeed_script, tmp_path):
    """gradient_accumulation_steps 4, boundaries set after 2 and then 3
    micro steps: the updates come there, each from the micro batches since
    the last one, divided by 4 as DeepSpeed divides them (SGD, torch)."""
    engine, model = engine_for(accumulation=4, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    torch.manual_seed(0)
    reference = nn.Linear(4, 2)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(2, 4, generator=g) for _ in range(5)]
    applied = []
    for i, x in enumerate(data):
        engine.set_gradient_accumulation_boundary(i in (1, 4))
        assert engine.is_gradient_accumulation_boundary() is (i in (1, 4))
        engine.backward(engine(x).square().mean())
        engine.step()
        applied.append(engine.was_step_applied())
        (reference(x).square().mean() / 4).backward()
        if i in (1, 4):
            opt.step()
            opt.zero_grad()
    assert applied == [False, True, False, False, True]
    assert engine.global_steps == 2
    full = engine.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-6, atol=1e-7)
    engine.save_checkpoint(tmp_path)  # after a boundary set by hand: nothing pending
    engine.set_gradient_accumulation_boundary(None)  # the count again: micro step 6 of 4
    assert engine.is_gradient_accumulation_boundary() is False
    with pytest.raises(TypeError, match="is_boundary must be True or False"):
        engine.set_gradient_accumulation_boundary("yes")
    engine.close()


def test_load_checkpoint_takes_deepspeeds_positional_arguments(deepspeed_script, tmp_path):
    engine, _ = engine_for()
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    saved = engine.full_state_dict()
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    # load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states
    path, _client = engine.load_checkpoint(tmp_path, None, True, False, False)
    assert path is not None
    assert torch.equal(engine.full_state_dict()["weight"], saved["weight"])
    with pytest.raises(ValueError, match="custom_load_fn"):
        engine.load_checkpoint(tmp_path, custom_load_fn=lambda *a: None)
    engine.close()


def _args(local_rank):
    import argparse
    return argparse.Namespace(local_rank=local_rank, deepspeed_config=None)


def test_args_local_rank_is_checked_taken_and_aligned(deepspeed_script, monkeypatch):
    """DeepSpeed's launcher passes --local_rank and sets LOCAL_RANK: a
    disagreement is refused (as DeepSpeed's assert does), an argument
    without the variable is taken into it (the engine reads the variable),
    and args.local_rank comes back as the engine's."""
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="args.local_rank is 0 but the launcher's LOCAL_RANK "
                                         "is 1"):
        deepspeed.initialize(args=_args(0), model=nn.Linear(4, 2), config=config)
    monkeypatch.delenv("LOCAL_RANK")
    args = _args(0)
    engine, *_ = deepspeed.initialize(args=args, model=nn.Linear(4, 2), config=config)
    import os
    assert os.environ["LOCAL_RANK"] == "0" and engine.local_rank == 0 and args.local_rank == 0
    engine.close()
    monkeypatch.delenv("LOCAL_RANK")
    args = _args(-1)  # the argument's default: aligned to the engine's
    engine, *_ = deepspeed.initialize(args=args, model=nn.Linear(4, 2), config=config)
    assert args.local_rank == engine.local_rank == 0
    engine.close()
    with pytest.raises(TypeError, match="args.local_rank must be an int"):
        deepspeed.initialize(args=_args("0"), model=nn.Linear(4, 2), config=config)


def test_global_grad_norm_answers_item_as_deepspeeds_tensor(deepspeed_script):
    """DeepSpeed's get_global_grad_norm() gives a 0-dim tensor at stages
    1-3; scripts log .item() of it: a number here, that answers .item()."""
    engine, model = engine_for(stage=2)
    assert engine.get_global_grad_norm() is None  # before the first step, as DeepSpeed's
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    engine.backward(engine(x).square().sum())
    engine.step()
    norm = engine.get_global_grad_norm()
    assert isinstance(norm.item(), float) and norm.item() == float(norm) > 0
    assert f"{norm:.3f}" == f"{float(norm):.3f}"
    engine.close()


def test_deepspeed_initialize_refuses_one_of_mpiruns_processes(deepspeed_script, monkeypatch):
    """deepspeed.initialize makes its own group through init_distributed:
    a process mpirun started two of, without torch's variables, is
    refused there too (it trained alone as a world of one)."""
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(RuntimeError, match=r"one of 2 that mpirun \(OpenMPI\) started"):
        deepspeed.initialize(model=nn.Linear(4, 2), config=config)
    with pytest.raises(RuntimeError, match="export WORLD_SIZE=1"):
        deepspeed.init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "1")  # each process alone, said so
    engine, *_ = deepspeed.initialize(model=nn.Linear(4, 2), config=config)
    assert engine.world_size == 1
    engine.close()



def test_the_other_queries_scripts_call(deepspeed_script):
    """Found missing by a DeepSpeed hunt (an AttributeError each)."""
    engine, _model = engine_for(stage=0, accumulation=2)
    assert engine.zero_optimization() is False and engine.wall_clock_breakdown() is False
    assert engine.get_batch_info() == (4, 2, 2)
    assert engine.get_data_types() == (torch.float32, torch.float32)
    assert engine.optimizer_name() == "adamw" and engine.training_dataloader is None
    engine.close()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = [(torch.randn(4), torch.randn(2)) for _ in range(6)]
    engine, optimizer, loader, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), training_data=data,
        config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "fp32"}})
    assert engine.zero_optimization() is True and engine.training_dataloader is loader
    assert engine.optimizer_name() == "SGD"
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    engine.close()
    assert (deepspeed.__version_major__, deepspeed.__version_minor__,
            deepspeed.__version_patch__) == (0, 19, 8)
    assert deepspeed.get_accelerator() is deepspeed.accelerator.get_accelerator()
    from zero.deepspeed.runtime.zero.partition_parameters import register_external_parameter
    assert register_external_parameter is deepspeed.zero.register_external_parameter

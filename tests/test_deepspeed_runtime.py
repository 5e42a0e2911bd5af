"""zero.deepspeed.runtime: the names scripts import from deepspeed.runtime
(lr_schedules built by hand, see_memory_usage and the norms of
runtime.utils, DeepSpeedEngine, RepeatingLoader, ZeroParamStatus).
Reference: DeepSpeed 0.19.8's numbers, recorded with the same calls
(its learning rates at construction and after each of 8 steps, on AdamW
at lr 0.01)."""
import math

import pytest
import torch
from torch import nn

import zero
import zero.deepspeed as deepspeed
from zero.deepspeed.runtime import lr_schedules
from engine_cases import no_launcher

DEEPSPEED_LRS = {  # deepspeed 0.19.8's, printed to 9 digits
    "WarmupLR_default": [0.0, 0.0, 0.005, 0.0079248125, 0.01, 0.01, 0.01, 0.01, 0.01],
    "WarmupLR_linear": [0.0001, 0.0001, 0.000575, 0.00105, 0.001525, 0.002, 0.002, 0.002,
                        0.002],
    "WarmupDecayLR": [0.0, 0.0, 0.000630929754, 0.001, 0.001, 0.000857142857, 0.000714285714,
                      0.000571428571, 0.000428571429],
    "WarmupCosineLR": [0.0, 0.0, 0.00630929754, 0.01, 0.00950489386, 0.00811763726,
                       0.00611299341, 0.00388800659, 0.00188336274],
    "OneCycle": [0.0001, 0.0034, 0.0067, 0.01, 0.0067, 0.0034, 0.0001, 0.0001, 0.0001],
    "LRRangeTest": [0.001, 0.00125, 0.0015, 0.00175, 0.002, 0.00225, 0.0025, 0.00275, 0.003],
}
BUILT = {  # the calls that recorded them
    "WarmupLR_default": lambda o: lr_schedules.WarmupLR(o, warmup_num_steps=4),
    "WarmupLR_linear": lambda o: lr_schedules.WarmupLR(o, 1e-4, 2e-3, 4, "linear"),
    "WarmupDecayLR": lambda o: lr_schedules.WarmupDecayLR(o, 10, warmup_num_steps=3),
    "WarmupCosineLR": lambda o: lr_schedules.WarmupCosineLR(o, 10, warmup_num_steps=3),
    "OneCycle": lambda o: lr_schedules.OneCycle(o, 1e-4, 1e-2, cycle_first_step_size=3),
    "LRRangeTest": lambda o: lr_schedules.LRRangeTest(o, 1e-3, 2, 0.5),
}


@pytest.mark.parametrize("name", sorted(DEEPSPEED_LRS))
def test_a_schedule_built_by_hand_gives_deepspeeds_rates(name):
    p = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([p], lr=0.01)
    schedule = BUILT[name](optimizer)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(8):
        optimizer.step()
        schedule.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx(DEEPSPEED_LRS[name], rel=1e-8, abs=1e-12)


# DeepSpeed 0.19.8's lr after step(5) and the step() after it, and its
# last_batch_iteration then (SGD at lr 0.1)
DEEPSPEED_JUMPS = {
    "WarmupLR": (lambda o: lr_schedules.WarmupLR(o, warmup_max_lr=0.1, warmup_num_steps=10,
                                                 warmup_type="linear"), 0.05, 0.06),
    "WarmupDecayLR": (lambda o: lr_schedules.WarmupDecayLR(
        o, total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear"),
        0.05, 0.06),
    "WarmupCosineLR": (lambda o: lr_schedules.WarmupCosineLR(o, total_num_steps=20,
                                                             warmup_num_steps=10),
                       0.07781513, 0.0845098),
    "OneCycle": (lambda o: lr_schedules.OneCycle(o, 0.01, 0.1, cycle_first_step_size=10),
                 0.064, 0.073),
    "LRRangeTest": (lambda o: lr_schedules.LRRangeTest(o, lr_range_test_step_size=1),
                    0.007, 0.008),
}


@pytest.mark.parametrize("name", sorted(DEEPSPEED_JUMPS))
def test_step_with_an_iteration_jumps_there_as_deepspeeds(name):
    """step(last_batch_iteration=5) sets iteration 5's rates (they were one
    iteration behind: torch's step(epoch)), and last_batch_iteration reads
    DeepSpeed's position (a DeepSpeed hunt)."""
    build, jumped, next_lr = DEEPSPEED_JUMPS[name]
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    schedule = build(optimizer)
    assert schedule.last_batch_iteration == -1
    schedule.step(5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(jumped, rel=1e-6)
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(next_lr, rel=1e-6)
    assert schedule.last_batch_iteration == 6 and schedule.get_last_lr() == \
        [optimizer.param_groups[0]["lr"]]


@pytest.mark.parametrize("stage", [0, 3])
def test_the_engine_steps_a_schedule_given_to_initialize(monkeypatch, stage):
    """initialize(lr_scheduler=WarmupDecayLR(...)): the engine steps it after
    each update, as DeepSpeed's does, so the rates are DeepSpeed's."""
    no_launcher(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    schedule = lr_schedules.WarmupDecayLR(optimizer, 10, warmup_num_steps=3)
    engine, _, _, returned = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=schedule,
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}})
    assert returned is schedule and isinstance(engine, deepspeed.DeepSpeedEngine)
    assert isinstance(engine, deepspeed.runtime.engine.DeepSpeedEngine)
    lrs = [engine.get_lr()[0]]
    for _ in range(8):
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()
        lrs.append(engine.get_lr()[0])
    engine.close()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    assert lrs == pytest.approx(DEEPSPEED_LRS["WarmupDecayLR"], rel=1e-8, abs=1e-12)


def test_a_wrong_schedule_argument_is_named():
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=0.01)
    with pytest.raises(ValueError, match="warmup_type must be 'log' or 'linear', got 'cos'"):
        lr_schedules.WarmupLR(optimizer, warmup_type="cos")
    with pytest.raises(TypeError, match="total_num_steps"):
        lr_schedules.WarmupDecayLR(optimizer)  # required, as DeepSpeed's


def test_see_memory_usage_prints_deepspeeds_lines_when_forced(capsys):
    """Printed, as DeepSpeed 0.19.8's print() does (it was logged at INFO
    first, which the default WARNING level hid: a DeepSpeed hunt)."""
    deepspeed.runtime.utils.see_memory_usage("before the step")  # no force: nothing
    assert capsys.readouterr().out == ""
    deepspeed.runtime.utils.see_memory_usage("before the step", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[0] == "before the step"
    assert lines[1] == "MA 0.0 GB Max_MA 0.0 GB CA 0.0 GB Max_CA 0 GB " or \
        torch.cuda.is_available()
    used = float(lines[2].split("used = ")[1].split(" GB")[0])
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    assert 0 < used * 1024 ** 3 < total


def test_the_norm_helpers():
    assert deepspeed.runtime.utils.get_global_norm([3.0, torch.tensor(4.0)]) == 5.0
    layer = nn.Linear(3, 2)
    layer(torch.randn(4, 3)).square().sum().backward()
    reference = nn.Linear(3, 2)
    reference.load_state_dict(layer.state_dict())
    for p, q in zip(layer.parameters(), reference.parameters()):
        q.grad = p.grad.clone()
    norm = deepspeed.runtime.utils.clip_grad_norm_(layer.parameters(), 0.1)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    assert isinstance(norm, float) and math.isclose(norm, float(expected), rel_tol=1e-6)
    for p, q in zip(layer.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(NotImplementedError, match="mpu=.*set gradient_clipping"):
        deepspeed.runtime.utils.clip_grad_norm_(layer.parameters(), 0.1, mpu=object())


def test_the_other_runtime_names_are_zeros():
    from zero.deepspeed.runtime.dataloader import RepeatingLoader
    from zero.deepspeed.runtime.zero import ZeroParamStatus
    from zero.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as same
    assert RepeatingLoader is deepspeed.utils.RepeatingLoader and ZeroParamStatus is same
    assert deepspeed.DeepSpeedEngine is zero.Engine
    again = iter(RepeatingLoader([1, 2]))
    assert [next(again) for _ in range(5)] == [1, 2, 1, 2, 1]


def test_the_memory_estimates_are_the_zero_formula():
    """Stage 3 without offload on 4 GPUs: 16 bytes a parameter over N on
    the GPU (bf16 parameter and gradient shards, fp32 master, m and v) and
    the largest layer gathered in bf16; the host holds each rank's built
    model (1/N of fp32 under zero_init), times the margin."""
    from zero.deepspeed.runtime.zero import _estimates
    width = 512  # layers above the persistence threshold: all partitioned
    model = nn.Sequential(*[nn.Linear(width, width, bias=False, device="meta")
                            for _ in range(8)])
    psi = 8 * width * width
    table = _estimates.rows(model, 3, num_gpus_per_node=4, num_nodes=1,
                            additional_buffer_factor=1.5)
    assert [text for _, _, text in table] == [
        f"offload_param={p:4}, offload_optimizer={o:4}, zero_init={z}"
        for p, o in (("cpu", "cpu"), ("none", "cpu"), ("none", "none")) for z in (1, 0)]
    cpu, gpu, _ = table[4]  # no offload, zero_init
    assert gpu == 16 * psi // 4 + 2 * width * width
    assert cpu == int(4 * psi // 4 * 4 * 1.5)
    assert table[5][0] == int(4 * psi * 4 * 1.5)
    cpu, gpu, _ = table[2]  # optimizer states offloaded: bf16 shards on the GPU
    assert gpu == 4 * psi // 4 + 2 * width * width and cpu > table[4][0]
    stage2 = _estimates.rows(model, 2, 2, 1, 1.0)
    assert stage2[1][1] == 2 * psi + 14 * psi // 2  # whole bf16 model, 14Ψ/N partitioned


def test_the_memory_estimate_tables_print(capsys):
    from zero.deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs_all_cold,
        estimate_zero3_model_states_mem_needs_all_live)
    from zero.deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs_all_cold)
    estimate_zero3_model_states_mem_needs_all_cold(7_000_000_000, 260_000_000,
                                                   num_gpus_per_node=8)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "SW: Model with 7000M total params, 260M largest layer params."
    assert lines[4] == "  per CPU  |  per GPU |   Options" and len(lines) == 11
    assert lines[9].endswith("GB | offload_param=none, offload_optimizer=none, zero_init=1")
    estimate_zero3_model_states_mem_needs_all_live(nn.Linear(4, 4), num_nodes=2)
    assert "HW: Setup with 2 nodes, 1 GPU per node." in capsys.readouterr().out
    estimate_zero2_model_states_mem_needs_all_cold(10 ** 9)
    assert len(capsys.readouterr().out.splitlines()) == 7
    with pytest.raises(ValueError, match="largest_layer_params .* is more than total_params"):
        estimate_zero3_model_states_mem_needs_all_cold(10, 20)
    with pytest.raises(ValueError, match="num_gpus_per_node must be an integer >= 1, got 0"):
        estimate_zero3_model_states_mem_needs_all_live(nn.Linear(4, 4), num_gpus_per_node=0)


def test_the_enums_and_aliases_scripts_import():
    from zero.deepspeed.runtime.activation_checkpointing import checkpointing
    from zero.deepspeed.runtime.zero.config import ZeroStageEnum
    from zero.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    assert [int(ZeroStageEnum[name]) for name in
            ("disabled", "optimizer_states", "gradients", "weights", "max_stage")] == \
        [0, 1, 2, 3, 3]
    config = zero.Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1,
                                         "zero_optimization": {"stage": 3}})
    assert config.stage == ZeroStageEnum.weights
    assert [d.value for d in OffloadDeviceEnum] == ["none", "cpu", "nvme"]
    assert OffloadDeviceEnum("nvme") == "nvme"
    assert checkpointing.checkpoint is deepspeed.checkpointing.checkpoint
    assert deepspeed.is_compile_supported() is hasattr(torch, "compile")

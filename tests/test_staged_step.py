"""The staged step (ZeRO-Offload: a GPU model whose master and states live
in host memory or files, _step_path.StagedHostStep), run on the CPU.

Only a GPU model takes this path. Here states_off_device is made true for
a CPU model, so the same code runs with the "device" and the host both the
CPU: every copy the step makes (gradients to the host buffer, parameters
back) is a real copy between separate buffers, and the master is a
separate fp32 tensor even in fp32. The update is the same C code over the
same values, so a staged run must equal the plain run bit for bit. On a
GPU, tests/gpu/test_engine.py runs it for real."""
import pytest
import torch

import zero
import zero.sharding._flat_group
import zero.step._step_path as step_path
from zero.offload._nvme import whole_pages
from engine_cases import (Net, apart_on_the_cpu, assert_checkpoint_chain_exact,
                          assert_same_finish, batches, finish, loss_of, make_optimizer,
                          no_launcher)


STAGING_CHUNK = 512  # several chunks a partition, so the windows are reused
STAGING_SLOTS = zero.sharding._flat_group.STAGING_SLOTS


@pytest.fixture(autouse=True)
def _staged_on_the_cpu(monkeypatch):
    no_launcher(monkeypatch)
    monkeypatch.setattr(step_path, "states_off_device", apart_on_the_cpu)
    monkeypatch.setattr(zero.sharding._flat_group, "STAGING_CHUNK", STAGING_CHUNK)


def run(stage, precision, optimizer, offload=None, steps=4, accumulation=1):
    torch.manual_seed(0)
    model = Net()
    options = {} if offload is None else {"offload_optimizer": offload}
    engine = zero.initialize(model, optimizer=make_optimizer(optimizer, model.parameters()),
                             stage=stage, precision=precision, gradient_clipping=0.5,
                             gradient_accumulation_steps=accumulation, **options)
    for tokens, targets in batches("cpu", steps * accumulation):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    return engine


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("optimizer", ["adamw", "adam_amsgrad", "lion", "sgd_nesterov",
                                       "adagrad"])
def test_staged_run_equals_the_plain_run(stage, precision, optimizer):
    expected = finish(run(stage, precision, optimizer, accumulation=2))
    engine = run(stage, precision, optimizer, offload={"device": "cpu"}, accumulation=2)
    assert isinstance(engine.step_path, step_path.StagedHostStep)
    for fg in engine.groups:
        assert fg.staged and fg.master is not fg.shard
        # STAGING_SLOTS windows end to end: one copied while the other is updated
        assert fg.host_windows["grad"].numel() == \
            STAGING_SLOTS * min(STAGING_CHUNK, fg.part_size)
    assert max(fg.part_size for fg in engine.groups) > 2 * STAGING_CHUNK
    assert_same_finish(finish(engine), expected)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("write_through", [False, True])
def test_staged_nvme_run_equals_the_plain_run(tmp_path, stage, write_through):
    expected = finish(run(stage, "bf16", "adamw"))
    engine = run(stage, "bf16", "adamw", offload={
        "device": "nvme", "nvme_path": str(tmp_path), "chunk_elements": 1024,
        "write_through": write_through})
    assert all(fg.staged and fg.offload.maps for fg in engine.groups)
    assert_same_finish(finish(engine), expected)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_memory_summary_puts_the_states_on_the_host(tmp_path, offload):
    config = {"device": offload, "nvme_path": str(tmp_path), "chunk_elements": 1024}
    engine = run(2, "bf16", "adamw", offload=config, steps=1)
    summary = engine.memory_summary()
    part = sum(fg.part_size for fg in engine.groups)
    assert summary["optimizer_states"] == 0  # none on the model's device
    # bf16 gradients in, bf16 parameters out: STAGING_SLOTS windows a side,
    # of a chunk each
    staging = sum(STAGING_SLOTS * min(STAGING_CHUNK if offload == "cpu" else 1024,
                                      fg.part_size) * (2 + 2) for fg in engine.groups)
    if offload == "cpu":
        assert summary["host"] == 12 * part + staging
        assert summary["offloaded"] == 0
    else:
        windows = sum(fg.offload.window_bytes(fg.part_size) for fg in engine.groups)
        assert summary["host"] == windows + staging
        assert summary["offloaded"] == sum(3 * whole_pages(4 * fg.part_size)
                                           for fg in engine.groups)
    assert summary["model_states"] == summary["params"] + summary["grads"]
    assert f"host memory {summary['host']:,} B (12Ψ/N" in summary["formula"]
    assert "host" in str(summary)
    engine.close()


def test_checkpoints_move_between_staged_and_plain_engines(tmp_path):
    assert_checkpoint_chain_exact(
        tmp_path, lambda: run(3, "bf16", "adamw", offload={"device": "cpu"}),
        lambda: run(1, "bf16", "adamw", steps=1),
        lambda: run(2, "bf16", "adamw", offload={"device": "cpu"}, steps=1))


def test_gathered_parameters_change_reaches_the_host_master():
    """Stage 3 writes a change made through GatheredParameters into the
    master, which is on the host: the next steps train from it, as in the
    plain run."""
    def change_and_train(offload):
        engine = run(3, "bf16", "adamw", offload=offload, steps=1)
        model = engine.module
        with zero.GatheredParameters([model.head.weight], modifier_rank=0):
            with torch.no_grad():
                model.head.weight.mul_(0.5)
        for tokens, targets in batches("cpu", 2):
            engine.backward(loss_of(engine(tokens), targets))
            engine.step()
        return finish(engine)
    assert_same_finish(change_and_train({"device": "cpu"}), change_and_train(None))


def test_a_cpu_model_is_not_staged_by_default(monkeypatch):
    monkeypatch.undo()  # the real predicate
    no_launcher(monkeypatch)
    engine = run(2, "bf16", "adamw", offload={"device": "cpu"}, steps=1)
    assert isinstance(engine.step_path, step_path.HostStep)
    assert not isinstance(engine.step_path, step_path.StagedHostStep)
    assert not any(fg.staged for fg in engine.groups)
    engine.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_estimate_for_a_gpu_model_is_what_the_staged_engine_holds(tmp_path, offload,
                                                                      precision, stage):
    """estimate_memory(device="cuda") with offload: the states in host
    memory, byte for byte as the staged engine reports them (here on the
    CPU, whose staging is the GPU's)."""
    config = {"device": offload, "nvme_path": str(tmp_path), "chunk_elements": 1024}
    torch.manual_seed(0)
    estimate = zero.estimate_memory(Net(), 1, stage=stage, precision=precision,
                                    device="cuda", offload_optimizer=config)
    engine = run(stage, precision, "adamw", offload=config, steps=1)
    summary = engine.memory_summary()
    engine.close()
    for key in ("params", "grads", "optimizer_states", "offloaded", "host", "persistent",
                "trainable_params"):
        assert estimate[key] == summary[key], key
    if stage < 3:
        assert estimate["formula"] == summary["formula"]

"""The engine's CUDA step: stages 0-3 on one GPU (world size 1: the group
is gloo, since one rank sends no model tensor) against plain torch training
on the same GPU (tests/engine_cases.py says
what is compared and within what).

On the emulated driver (ZERO_TEST_EMULATED_CUDA=1, run by
tests/test_cuda_emulated.py) the model stays on the CPU and the engine is
given the CUDA step all the same, so the norm and Adam kernels run through
the binding on the engine's own buffers: everything but the GPU memory
and NCCL is exercised. Skips without either.
"""
import gc

import pytest
import torch

import engine_cases
import zero.comm._comm
import zero.engine._engine
from gpu_device import DEVICE, EMULATED, SKIP_REASON, device_path  # noqa: F401 (fixture)
from zero.step._step_path import CudaStep, StagedHostStep

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

STAGES = [0, 1, 2, 3]


@pytest.fixture(autouse=True)
def cuda_step(monkeypatch):
    """The engine must take the CUDA step (emulated: it is handed it)."""
    if EMULATED:
        monkeypatch.setattr(zero.engine._engine, "step_path_for", lambda device: CudaStep(device))
    engine_cases.no_launcher(monkeypatch)


@pytest.mark.parametrize("stage", STAGES)
def test_adamw_with_accumulation_and_clipping_matches_torch(stage):
    engine = engine_cases.compare_with_torch(DEVICE, stage)
    assert isinstance(engine.step_path, CudaStep)


@pytest.mark.parametrize("build", ["on cpu", "partitioned"])
@pytest.mark.parametrize("stage", [0, 3])
def test_initialize_moves_the_model_to_the_device(stage, build):
    engine_cases.compare_with_torch(DEVICE, stage, build=build)


@pytest.mark.parametrize("optimizer", ["adamw_maximize", "adam_amsgrad", "sgd_nesterov",
                                       "adagrad"])
@pytest.mark.parametrize("stage", [0, 3])
def test_other_optimizers_match_torch(stage, optimizer):
    engine_cases.compare_with_torch(DEVICE, stage, optimizer)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_matches_mixed_precision_torch(stage):
    engine_cases.bf16_matches_mixed_precision_torch(DEVICE, stage)


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_skips_the_step(stage):
    engine_cases.fp16_overflow_skips(DEVICE, stage)


@pytest.mark.skipif(EMULATED, reason="needs CUDA tensors and NCCL")
def test_engine_buffers_live_on_the_gpu_and_one_rank_needs_no_nccl():
    model, _ = engine_cases.pair(DEVICE)
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=2,
                             precision="bf16")
    for fg in engine.groups:
        for name, t in fg.tensors.items():
            assert t is None or t.device == DEVICE, name
    # one rank sends no model tensor: the group is gloo, no NCCL to set up
    assert "nccl" not in zero.comm._comm.group_backend()
    engine.close()


@pytest.mark.skipif(EMULATED, reason="needs CUDA tensors and NCCL")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_summary_is_what_the_gpu_allocator_holds(stage):
    """The model states memory_summary() reports are the bytes the engine
    took from the GPU (before any step: no buckets, nothing gathered),
    within 1 MiB of small tensors (step counts, the norm's scratch)."""
    gc.collect()  # no earlier test's tensors freed while we measure
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(DEVICE)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # built on CPU
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                             stage=stage, precision="bf16", device=DEVICE)
    taken = torch.cuda.memory_allocated(DEVICE) - before
    summary = engine.memory_summary()
    reported = summary["params"] + summary["grads"] + summary["optimizer_states"]
    assert abs(taken - reported) <= 2**20, (taken, dict(summary))
    engine.close()


@pytest.mark.skipif(EMULATED, reason="needs CUDA tensors")
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", STAGES)
def test_states_offloaded_to_the_host_match_torch(tmp_path, stage, offload):
    """ZeRO-Offload: the master and states in host memory (or files), the
    C core steps them, the GPU holds parameters and gradients only."""
    config = {"device": offload, "nvme_path": str(tmp_path), "chunk_elements": 1024}
    engine = engine_cases.compare_with_torch(DEVICE, stage, offload_optimizer=config)
    assert isinstance(engine.step_path, StagedHostStep)
    for fg in engine.groups:
        assert fg.master.device.type == "cpu"
        assert all(t.device.type == "cpu" for t in fg.states.values())
        assert all(w.is_pinned() for w in fg.host_windows.values())


@pytest.mark.skipif(EMULATED, reason="needs CUDA tensors")
@pytest.mark.parametrize("stage", [1, 3])
def test_offloaded_states_take_no_gpu_memory(stage):
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(DEVICE)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                             stage=stage, precision="bf16", device=DEVICE,
                             offload_optimizer={"device": "cpu"})
    taken = torch.cuda.memory_allocated(DEVICE) - before
    summary = engine.memory_summary()
    assert summary["optimizer_states"] == 0 and summary["host"] > 0
    assert abs(taken - (summary["params"] + summary["grads"])) <= 2**20, (taken, dict(summary))
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_optim_built_on_the_device_trains_as_one_built_on_the_host(stage):
    """zero.optim's Lion (no kernel: torch ops) from parameters already on
    the device, and from the same model still on the host then moved by
    initialize(device=): the engine runs both the same way."""
    finals = []
    for where in ("device", "host"):
        torch.manual_seed(0)
        model = engine_cases.Net().to(DEVICE if where == "device" else "cpu")
        engine = zero.initialize(model, optimizer=zero.optim.Lion(model.parameters(), lr=1e-3),
                                 stage=stage, device=DEVICE,
                                 stage3_param_persistence_threshold=0)
        engine_cases.engine_run(engine, engine_cases.batches(DEVICE, 4))
        finals.append(engine.full_state_dict())
        engine.close()
    for name, value in finals[0].items():
        assert torch.equal(value, finals[1][name]), name


def test_checkpoint_moves_between_the_gpu_and_the_host(tmp_path):
    """Saved from the device at stage 3, loaded on the host at stage 1 and
    back on the device at stage 2: each restore is exact."""
    def engine_on(device, stage, seed):
        torch.manual_seed(seed)
        model = engine_cases.Net()
        return zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                               stage=stage, precision="bf16", device=device)
    first = engine_on(DEVICE, 3, 0)
    engine_cases.engine_run(first, engine_cases.batches(DEVICE, 3))
    first.save_checkpoint(tmp_path / "a")
    saved = first.full_state_dict()
    first.close()
    host = engine_on(torch.device("cpu"), 1, 1)
    host.load_checkpoint(tmp_path / "a")
    host.save_checkpoint(tmp_path / "b")
    assert all(torch.equal(v, saved[k]) for k, v in host.full_state_dict().items())
    host.close()
    again = engine_on(DEVICE, 2, 2)
    again.load_checkpoint(tmp_path / "b")
    assert again.global_steps == 3
    assert all(torch.equal(v, saved[k]) for k, v in again.full_state_dict().items())
    again.close()

"""Stage 3's parameter offload on a GPU (offload_param "cpu" or "nvme": the
shard in page-locked host memory or a file, each unit's chunk copied to
the GPU on a side stream before its gather), against stage 3 in memory on
the same GPU, bit for bit: the values are the same and so is the update.

On the emulated driver (tests/test_cuda_emulated.py) the model stays on
the CPU and params_off_device is made true, so the copies run between
host buffers and the CUDA step's kernels update the device master before
the new parameters are copied into the host shard. The GPU memory checks
need a GPU."""
import gc

import pytest
import torch
from torch import nn

import engine_cases
import zero
import zero.engine._engine
import zero.offload._param_staging as param_staging
import zero.step._step_path as step_path
from gpu_device import DEVICE, EMULATED, SKIP_REASON, device_path  # noqa: F401 (fixture)
from zero.step._step_path import CudaStep

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)


@pytest.fixture(autouse=True)
def placement(monkeypatch):
    engine_cases.no_launcher(monkeypatch)
    if EMULATED:
        monkeypatch.setattr(param_staging, "params_off_device", engine_cases.apart_on_the_cpu)
        monkeypatch.setattr(step_path, "states_off_device", engine_cases.apart_on_the_cpu)
        monkeypatch.setattr(zero.engine._engine, "step_path_for", lambda device: CudaStep(device))


def run(tmp_path, precision, params=None, states=None, steps=3):
    options = engine_cases.offload_options(tmp_path, params, states)
    torch.manual_seed(0)
    model = engine_cases.Net()  # built on the host; initialize moves it
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=3, precision=precision, device=DEVICE, gradient_clipping=0.5,
                             gradient_accumulation_steps=2, stage3_param_persistence_threshold=0,
                             **options)
    for tokens, targets in engine_cases.batches(DEVICE, 2 * steps):
        engine.backward(engine_cases.loss_of(engine(tokens), targets))
        engine.step()
    return engine


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("params,states", [("cpu", None), ("nvme", None), ("cpu", "cpu"),
                                           ("nvme", "nvme")])
def test_offloaded_parameters_equal_stage3_in_memory(tmp_path, precision, params, states):
    expected = engine_cases.finish(run(tmp_path, precision, states=states))
    engine = run(tmp_path, precision, params, states)
    for fg in engine.all_groups:
        assert fg.shard_on_host and fg.shard.device.type == "cpu"
        if not EMULATED:
            assert fg.master.device.type == ("cpu" if states else "cuda")
            if params == "cpu":
                assert fg.shard.is_pinned()
            for unit in fg.units:  # released: nothing of it left on the GPU
                assert unit.full.device == DEVICE and unit.full.untyped_storage().nbytes() == 0
    engine_cases.assert_same_finish(engine_cases.finish(engine), expected)


@pytest.mark.skipif(EMULATED, reason="needs CUDA tensors (GPU memory)")
def test_memory_summary_is_what_the_gpu_allocator_holds():
    """With the shard, the gradients and the states on the host, the GPU
    holds nothing between steps but what memory_summary() says (within
    1 MiB of small tensors)."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(DEVICE)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             precision="bf16", device=DEVICE,
                             offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    taken = torch.cuda.memory_allocated(DEVICE) - before
    summary = engine.memory_summary()
    assert summary["grads"] == summary["optimizer_states"] == 0 and summary["host"] > 0
    assert abs(taken - summary["params"]) <= 2**20, (taken, dict(summary))
    engine.close()


@pytest.mark.skipif(EMULATED, reason="needs CUDA tensors (GPU memory)")
def test_a_model_too_large_for_the_allowed_memory_trains_with_offload():
    """Under a 1 GiB cap on this process's GPU memory, a 268M-parameter
    model (16 bytes a parameter of model states: 4.3 GB at stage 3 on one
    rank) cannot even be set up without offload; with parameters and
    states on the host it trains, and its loss falls."""
    total = torch.cuda.get_device_properties(DEVICE).total_memory
    torch.cuda.set_per_process_memory_fraction(2**30 / total, DEVICE)
    try:
        def model():
            torch.manual_seed(0)
            return nn.Sequential(*[nn.Sequential(nn.Linear(4096, 4096), nn.Tanh())
                                   for _ in range(16)])
        with pytest.raises(torch.OutOfMemoryError):
            m = model()
            zero.initialize(m, optimizer=torch.optim.AdamW(m.parameters()), stage=3,
                            precision="bf16", device=DEVICE)
        gc.collect()
        torch.cuda.empty_cache()
        m = model()
        engine = zero.initialize(m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4),
                                 stage=3, precision="bf16", device=DEVICE,
                                 offload_param={"device": "cpu"},
                                 offload_optimizer={"device": "cpu"})
        g = torch.Generator(device=DEVICE).manual_seed(0)
        x = torch.randn(8, 4096, device=DEVICE, generator=g)
        target = torch.randn(8, 4096, device=DEVICE, generator=g)
        losses = []
        for _ in range(4):
            loss = (engine(x).float() - target).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], losses
        assert torch.cuda.max_memory_allocated(DEVICE) <= 2**30
        engine.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, DEVICE)
        gc.collect()
        torch.cuda.empty_cache()

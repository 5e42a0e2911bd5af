"""The GPU's fallback step (torch ops, used where zero's kernels cannot run
and for the optimizers they do not cover) runs on any device: here it
drives the engine on the CPU, stages 0-3, against plain torch training
(tests/engine_cases.py). The CUDA step is tests/gpu/test_engine.py's."""
import pytest
import torch
import torch.distributed as dist

import engine_cases
import zero.engine
from zero._step_path import HostStep, TorchStep, step_path_for

CPU = torch.device("cpu")


@pytest.fixture
def torch_step(monkeypatch, request):
    monkeypatch.setattr(zero.engine, "step_path_for", lambda device: TorchStep(device))
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    had_group = dist.is_initialized()
    yield
    # zero.partitioned_init leaves its group for the life of the process
    if getattr(request.node, "callspec", None) is None or \
            request.node.callspec.params.get("build") != "partitioned":
        assert dist.is_initialized() == had_group, "an engine left its process group behind"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_adamw_with_accumulation_and_clipping(torch_step, stage):
    engine = engine_cases.compare_with_torch(CPU, stage)
    assert isinstance(engine.step_path, TorchStep)


@pytest.mark.parametrize("build", ["on cpu", "partitioned"])
@pytest.mark.parametrize("stage", [1, 3])
def test_initialize_with_a_device(torch_step, stage, build):
    engine_cases.compare_with_torch(CPU, stage, build=build)


@pytest.mark.parametrize("optimizer", ["adam_amsgrad", "sgd_nesterov", "adagrad"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_other_optimizers(torch_step, stage, optimizer):
    engine_cases.compare_with_torch(CPU, stage, optimizer)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16(torch_step, stage):
    engine_cases.bf16_matches_mixed_precision_torch(CPU, stage)


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_skips(torch_step, stage):
    engine_cases.fp16_overflow_skips(CPU, stage)


def test_the_cpu_keeps_the_c_core():
    assert isinstance(step_path_for(CPU), HostStep)


def test_other_devices_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="not mps"):
        step_path_for(torch.device("mps"))


def test_a_gpu_without_usable_kernels_falls_back_with_a_warning():
    if zero._C.cuda_available():
        assert type(step_path_for(torch.device("cuda"))).__name__ == "CudaStep"
        return
    with pytest.warns(RuntimeWarning, match="kernels cannot run here .*torch ops"):
        assert isinstance(step_path_for(torch.device("cuda")), TorchStep)


def test_models_zero_cannot_place_are_refused(torch_step):
    split = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    for model in (split, torch.nn.Linear(2, 2, device="meta")):
        for device in (None, "cpu"):  # meta has no values to move
            with pytest.raises(ValueError, match="meta device.*partitioned_init"):
                zero.initialize(model, device=device)


def test_a_group_that_cannot_reduce_the_model_tensors_is_refused(torch_step):
    from zero._comm import check_backend
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        check_backend(torch.device("cpu"))
        with pytest.raises(RuntimeError, match="cannot reduce the model's cuda tensors.*nccl"):
            check_backend(torch.device("cuda"))
    finally:
        if made:
            dist.destroy_process_group()


def test_device_argument_is_checked_by_name(torch_step):
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="device='gpu0' is not a device"):
        zero.initialize(m, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda', but torch.cuda.is_available\(\)"):
            zero.initialize(m, device="cuda")
    with pytest.raises(NotImplementedError, match="not on mps"):
        zero.initialize(m, device="mps")

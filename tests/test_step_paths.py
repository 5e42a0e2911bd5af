"""The GPU's fallback step (torch ops, used where zero's kernels cannot run
and for the optimizers they do not cover) runs on any device: here it
drives the engine on the CPU, stages 0-3, against plain torch training
(tests/engine_cases.py). The CUDA step is tests/gpu/test_engine.py's."""
import contextlib

import pytest
import torch
import torch.distributed as dist

import engine_cases
import zero.engine._engine
from zero.step._step_path import HostStep, TorchStep, _kernels_unusable, step_path_for

CPU = torch.device("cpu")


@pytest.fixture
def torch_step(monkeypatch, request):
    monkeypatch.setattr(zero.engine._engine, "step_path_for", lambda device: TorchStep(device))
    engine_cases.no_launcher(monkeypatch)
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


@pytest.mark.parametrize("optimizer", ["adamw_maximize", "adam_amsgrad", "sgd_nesterov",
                                       "adagrad", "lion"])
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
    if _kernels_unusable(torch.device("cuda")) is None:  # a GPU the kernels run on
        assert type(step_path_for(torch.device("cuda"))).__name__ == "CudaStep"
        return
    with pytest.warns(RuntimeWarning, match="kernels cannot run here .*torch ops"):
        assert isinstance(step_path_for(torch.device("cuda")), TorchStep)


def test_a_kernel_launch_that_fails_at_initialize_means_the_torch_step(monkeypatch):
    """The driver opens but the fatbin does not load (a driver older than
    the nvcc that built it): found by the probe launch, not at step 1."""
    from zero.step import _cuda

    def fails(*_args, **_kwargs):
        raise RuntimeError("cuda_l2_norm: cuModuleLoadData failed: CUDA_ERROR_UNSUPPORTED_PTX")
    monkeypatch.setattr(_cuda, "available", lambda: True)
    monkeypatch.setattr(_cuda, "l2_norm", fails)
    monkeypatch.setattr(torch.cuda, "device", lambda _device: contextlib.nullcontext())
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: None)
    with pytest.warns(RuntimeWarning, match="UNSUPPORTED_PTX.*torch ops"):
        assert isinstance(step_path_for(torch.device("cuda", 0)), TorchStep)


def test_models_zero_cannot_place_are_refused(torch_step):
    split = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    for model in (split, torch.nn.Linear(2, 2, device="meta")):
        for device in (None, "cpu"):  # meta has no values to move
            with pytest.raises(ValueError, match="meta device.*partitioned_init"):
                zero.initialize(model, device=device)


def test_a_group_that_cannot_reduce_the_model_tensors_is_refused(torch_step, monkeypatch):
    from zero.comm import _comm, _host_staging
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _comm.check_backend(torch.device("cpu"))
        _comm.check_backend(torch.device("cuda"))  # one rank: no model tensor is ever sent
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
        # the user's gloo group: a GPU model's collectives go through host
        # memory ([Note: host-staged collectives]), said once a process
        monkeypatch.setattr(_comm, "_holds_current_group", lambda: False)
        monkeypatch.setitem(_host_staging._warned, "staged", False)
        with pytest.warns(RuntimeWarning, match="host memory and runs on gloo"):
            _comm.check_backend(torch.device("cuda"))
        # one zero made for a CPU engine still open: closing it gives NCCL
        monkeypatch.setattr(_comm, "_holds_current_group", lambda: True)
        with pytest.raises(RuntimeError, match="cuda tensors need nccl: close"):
            _comm.check_backend(torch.device("cuda"))
        # ...unless the ranks share a GPU, where NCCL cannot run
        monkeypatch.setattr(_comm, "ranks_share_a_gpu", lambda: True)
        _comm.check_backend(torch.device("cuda"))
        monkeypatch.setattr(_comm, "group_backend", lambda group=None: "nccl")
        monkeypatch.setattr(_comm, "_holds_current_group", lambda: False)
        with pytest.raises(RuntimeError, match="cannot reduce the model's cpu tensors"):
            _comm.check_backend(torch.device("cpu"))
    finally:
        if made:
            dist.destroy_process_group()


def test_ranks_sharing_a_gpu_take_gloo_and_stage_through_host(monkeypatch):
    from zero.comm import _comm, _host_staging
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = torch.device("cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not _host_staging.ranks_share_a_gpu()
    assert _comm.backend_for(cuda, 2) == "cpu:gloo,cuda:nccl"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _host_staging.ranks_share_a_gpu()
    assert _comm.backend_for(cuda, 2) == "gloo"
    assert _comm.backend_for(torch.device("cpu"), 2) == "gloo"
    # a launcher that gives each rank one GPU of its own looks the same from
    # inside a rank: no guess, NCCL
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert not _host_staging.ranks_share_a_gpu()
    assert _comm.backend_for(cuda, 2) == "cpu:gloo,cuda:nccl"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")  # not torchrun's: no guess
    assert not _host_staging.ranks_share_a_gpu()


def test_device_argument_is_checked_by_name(torch_step):
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="device='gpu0' is not a device"):
        zero.initialize(m, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda', but torch.cuda.is_available\(\)"):
            zero.initialize(m, device="cuda")
    with pytest.raises(NotImplementedError, match="not on mps"):
        zero.initialize(m, device="mps")


def test_gathering_the_master_in_slices_puts_each_rank_in_its_chunk():
    """The GPU's full_state_dict gathers in slices (_flat_group.gather_in_slices);
    a stand-in for the collective gives what three ranks would send."""
    from zero.sharding._flat_group import gather_in_slices
    n, part = 3, 10
    chunks = [torch.arange(part, dtype=torch.float32) + 100 * r for r in range(n)]

    class ThreeRanks:
        device = torch.device("cpu")  # the model's, where the slices travel

        def all_gather_into(self, output, mine):
            lo = int(mine[0].item()) % 100  # rank 1's values: its offset in the chunk
            width = mine.numel()
            output.copy_(torch.cat([c[lo:lo + width] for c in chunks]))

    out = torch.full((n * part,), -1.0)
    gather_in_slices(ThreeRanks(), out, chunks[1].clone(), n, slice_elements=4)
    assert torch.equal(out, torch.cat(chunks))


def test_zero_optim_off_the_host_is_driven_by_the_engine_only():
    # built as torch's are (zero.estimate_memory builds a config's Lion on a
    # meta model; it was refused there), refused at the step
    meta = zero.optim.AdamW([torch.nn.Parameter(torch.empty(3, device="meta"))])
    with pytest.raises(ValueError, match="^parameter 0 of param group 0 is on the meta device: "
                                         "it has no values to update$"):
        meta.step()
    # a stand-in device (the GPU's case): built, but only an engine can step it
    opt = zero.optim.Lion([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    opt._off_host = "parameter 0 of param group 0 is on cuda:0"
    with pytest.raises(ValueError, match="is on cuda:0; zero.optim optimizers step on the CPU"):
        opt.step()


def test_device_cuda_gives_each_local_rank_a_gpu_and_wraps_past_the_last(monkeypatch):
    """device="cuda" under a launcher is cuda:LOCAL_RANK, made current; ranks
    beyond the node's GPUs share them (LOCAL_RANK modulo the count)."""
    from zero.engine._initialize import _engine_device
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    model = torch.nn.Linear(2, 2)
    for local, index in (("0", 0), ("1", 1), ("3", 1), ("4", 0)):
        monkeypatch.setenv("LOCAL_RANK", local)
        assert _engine_device(model, "cuda") == torch.device("cuda", index)
    assert chosen == [torch.device("cuda", i) for i in (0, 1, 1, 0)]
    assert _engine_device(model, "cuda:1") == torch.device("cuda", 1)  # as given

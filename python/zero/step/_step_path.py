"""Where the optimizer step of the flat groups runs: chosen once per engine
from the device of the model's parameters (docs/engine.md, "Devices").

- HostStep: the states are in host memory (or in files, offload_optimizer
  "nvme", stepped chunk by chunk through RAM windows); the C core updates
  them over registered Buffers, with the SIMD path picked at run time.
- CudaStep: the states are on the GPU; zero's fused kernels take the norm
  and run Adam/AdamW, launched on torch's current stream. What the kernels
  do not cover (SGD, Adagrad, Lion, amsgrad) runs as torch ops.
- TorchStep: torch ops only, for a GPU on which the kernels cannot run
  (zero built without nvcc, a driver too old for the fatbin, found by one
  tiny launch at initialize): slower, and said so in a warning.

squared_norm() returns the global squared L2 norm of the gradients as a
Python float. That is the one host synchronisation of a GPU step: the clip
coefficient and the fp16 skip decision are made on the host from it.
"""
from __future__ import annotations

import contextlib

import torch

from zero._warnings import warn_user
from zero._C import Buffer, cpu_info, sum_squares
from zero.step._torch_update import adam as torch_adam
from zero.step._hyperparameters import check_group_settings
from zero.step._registry import run_update
from zero.step._staged_copies import StagedCopies


def check_update_arguments(spec, optimizer, group, step):
    """Run the update's argument checks (the C core's, which every step
    path's settings share) over no elements: a param group whose settings
    the update would refuse (nesterov without momentum, a negative lr)
    raises here, before any group is updated. What the C core cannot see
    (differentiable=True, an lr of "0.01") is checked first."""
    check_group_settings(group)
    empty = Buffer(torch.empty(0))
    buffers = {name: empty for name in ("master", "grad", "exp_avg", "exp_avg_sq",
                                         "max_exp_avg_sq", "momentum_buffer", "sum")}
    buffers["copy_out"] = None
    run_update(spec, optimizer, group, buffers, step, 1.0, spec.host)


def check_every_group(spec, optimizer, groups):
    """Every flat group's settings as the update will take them, checked
    before the first group is updated: a later group's refusal would
    otherwise leave the step half applied."""
    for fg in groups:
        try:
            check_update_arguments(spec, optimizer, optimizer.param_groups[fg.index],
                                   fg.step_count + 1)
        except (ValueError, TypeError) as error:
            raise type(error)(f"optimizer param group {fg.index}: {error}; nothing was "
                              "updated") from None


def check_settings_at_initialize(optimizer):
    """What check_group_settings refuses at every step (differentiable=True,
    an lr of "0.01"), refused by initialize too: found first at step(), it
    came after a whole forward and backward."""
    for index, group in enumerate(optimizer.param_groups):
        try:
            check_group_settings(group)
        except (ValueError, TypeError) as error:
            raise type(error)(f"optimizer param group {index}: {error}") from None


def chunk_buffers(fg, lo, hi, windows):
    """C Buffers over elements [lo, hi) of a group's update operands: the
    RAM window where `windows` has one (offload files, staging), else the
    slice of the group's own tensor (None stays None: no copy-out)."""
    buffers = {}
    for name in ("master", "grad", "copy_out", *fg.states):
        t = windows.get(name)
        if t is None:
            t = fg.tensors[name]
            t = None if t is None else t[lo:hi]
        buffers[name] = None if t is None else Buffer(t)
    return buffers


def chunk_ranges(fg, chunk: int) -> list:
    """The (lo, hi) chunks a chunked update walks: the states' files' own
    chunks where they are in files, else `chunk` elements at a time."""
    if fg.offload is not None and fg.offload.maps:
        return fg.offload.chunks(fg.part_size)
    chunk = max(1, chunk)
    return [(lo, min(lo + chunk, fg.part_size)) for lo in range(0, fg.part_size, chunk)]


def run_in_chunks(fg, ranges, update_chunk):
    """update_chunk(lo, hi, windows) over chunk_ranges' chunks: through the
    files' RAM windows, the next chunk read and the last written while one
    is updated ([Note: offloaded step] in _nvme.py), or over the group's
    own tensors (windows empty)."""
    if fg.offload is not None and fg.offload.maps:
        fg.offload.paged_update(fg.part_size, update_chunk)
    else:
        for lo, hi in ranges:
            update_chunk(lo, hi, {})


def update_delayed(spec, optimizer, group, fg, grad_scale, step_count):
    """The update of a delayed step ([Note: delayed update] in
    _delayed.py), on its thread: host memory only, from the gradient copy
    into the new-parameter buffer (the states' files' windows for
    "nvme"). HostStep's and StagedHostStep's alike."""
    def update_chunk(lo, hi, windows):
        buffers = chunk_buffers(fg, lo, hi, {**windows, "grad": fg.delayed_grad[lo:hi],
                                             "copy_out": fg.delayed_params[lo:hi]})
        run_update(spec, optimizer, group, buffers, step_count, grad_scale, spec.host)
    run_in_chunks(fg, chunk_ranges(fg, fg.part_size), update_chunk)


class HostStep:
    def __init__(self):
        self.name = f"cpu: zero C core ({cpu_info()['simd']})"

    update_delayed = staticmethod(update_delayed)

    def squared_norm(self, groups, comm, across_ranks: bool) -> float:
        local = sum(sum_squares(fg.grad_part) for fg in groups)
        return comm.sum_scalar(local) if across_ranks else local

    def update(self, spec, optimizer, group, fg, grad_scale):
        fg.check_shard_writable()

        def update_chunk(lo, hi, windows):
            run_update(spec, optimizer, group, chunk_buffers(fg, lo, hi, windows),
                       fg.step_count, grad_scale, spec.host)
            # the new parameters went through the shard's mapping: a shard
            # on a disk keeps only this chunk resident
            fg.drop_param_pages(slice(lo, hi))
        if (fg.offload is not None and fg.offload.maps) or fg.param_files is not None:
            # states or the shard in files: chunk by chunk
            chunk = fg.param_files.chunk if fg.param_files is not None else fg.part_size
            run_in_chunks(fg, chunk_ranges(fg, chunk), update_chunk)
        else:  # all in memory: one call over the registered buffers
            run_update(spec, optimizer, group, fg.current_buffers(), fg.step_count,
                       grad_scale, spec.host)


class StagedHostStep:
    """[Note: staged step] A model on a GPU whose master and states live in
    host memory or in files (offload_optimizer "cpu" or "nvme": ZeRO-
    Offload). The norm is taken where the gradients are, on the device,
    as without offload. The update then walks each group's partition in
    chunks: a chunk of the reduced gradients is copied into a page-locked
    host window, the C core updates that chunk of the host master and
    states (for "nvme", the chunk the files' windows hold: _nvme.py), and
    writes the rounded parameters into a second window, which is copied
    over the device's partition before the all-gather. The copies of
    other chunks run on streams of their own meanwhile, ordered by events
    ([Note: pipelined staged step] in _staged_copies.py). The device holds
    only parameters and gradients; the host, the states and two windows a
    side of a chunk each."""

    def __init__(self, device):
        self.device = device
        self._norm = _norm_path(device)
        self.name = f"{device.type} model, states on the host: zero C core " \
                    f"({cpu_info()['simd']})"

    def squared_norm(self, groups, comm, across_ranks: bool) -> float:
        if groups and groups[0].grads_on_host:  # every group's, or none's
            return HostStep.squared_norm(self, groups, comm, across_ranks)
        return self._norm.squared_norm(groups, comm, across_ranks)

    def update(self, spec, optimizer, group, fg, grad_scale):
        ranges = chunk_ranges(fg, fg.staging_chunk)
        # [Note: pipelined staged step] in _staged_copies.py
        copies = StagedCopies(fg, ranges)
        index = {lo: i for i, (lo, _hi) in enumerate(ranges)}

        def update_chunk(lo, hi, windows):
            i = index[lo]
            staged = dict(windows)
            grad, out = copies.grad(i), copies.out(i)
            if grad is not None:
                staged["grad"] = grad
            if out is not None:
                staged["copy_out"] = out
            run_update(spec, optimizer, group, chunk_buffers(fg, lo, hi, staged),
                       fg.step_count, grad_scale, spec.host)
            copies.send(i, out)
        try:
            run_in_chunks(fg, ranges, update_chunk)
        finally:
            copies.finish()

    update_delayed = staticmethod(update_delayed)


class TorchStep:
    def __init__(self, device):
        self.device = device
        self.name = f"{device.type}: torch ops"

    def _local_squared_norm(self, groups) -> torch.Tensor:
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for fg in groups:
            # fp32 accumulation reads bf16/fp16 in place; asking for float64
            # would first copy the partition to float64
            local += torch.linalg.vector_norm(fg.grad_part, dtype=torch.float32).double().square()
        return local

    def squared_norm(self, groups, comm, across_ranks: bool) -> float:
        total = self._local_squared_norm(groups).reshape(1)
        if across_ranks:
            comm.sum_scalars_(total)
        return float(total.item())

    def update(self, spec, optimizer, group, fg, grad_scale):
        run_update(spec, optimizer, group, fg.tensors, fg.step_count, grad_scale,
                   spec.torch)


class CudaStep(TorchStep):
    def __init__(self, device):
        import zero.step._cuda as _cuda  # imported only for a model on a GPU
        super().__init__(device)
        self._cuda = _cuda
        self.name = f"{device.type}: zero CUDA kernels"
        self._step_counts = {}  # id(master) -> the kernel's 1-element step tensor

    def _on_device(self):
        # torch exports a CUDA tensor through DLPack only while its device
        # is the current one (a rank of torchrun that never called
        # set_device would fail)
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()  # the emulated driver's host tensors

    def _local_squared_norm(self, groups) -> torch.Tensor:
        with self._on_device():
            return self._cuda.l2_norm([fg.grad_part for fg in groups], squared=True).double()

    def update(self, spec, optimizer, group, fg, grad_scale):
        with self._on_device():
            run_update(spec, optimizer, group, fg.tensors, fg.step_count, grad_scale,
                       self._adam if spec.cuda_kernel else spec.torch)

    def _adam(self, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, copy_out, *, lr, beta1,
              beta2, eps, weight_decay, step, decoupled, amsgrad, grad_scale):
        """zero.adam_step's arguments, run by the kernel (amsgrad, which
        the kernel lacks, by torch ops)."""
        if amsgrad:
            return torch_adam(
                param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, copy_out, lr=lr, beta1=beta1,
                beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                decoupled=decoupled, amsgrad=True, grad_scale=grad_scale)
        count = self._step_counts.get(id(param))
        if count is None:
            count = self._step_counts[id(param)] = torch.zeros(1, dtype=torch.float32,
                                                                device=param.device)
        # The kernel advances the count on the device (so that a flagged
        # step is skipped without the host); set it from the host's count,
        # which stays the one the engine saves and restores.
        count.fill_(step - 1)
        self._cuda.adam_step(param, grad, exp_avg, exp_avg_sq, step=count, lr=lr,
                             betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                             decoupled=decoupled, grad_scale=grad_scale, copy_out=copy_out)


def states_off_device(device: torch.device, offload) -> bool:
    """Whether the master and states live in host memory (or files) apart
    from a model on `device`: offload_optimizer "cpu" or "nvme" for a model
    that is not on the host already (tests/test_staged_step.py makes this
    true for a CPU model, to run the staged step's copies on the CPU)."""
    return device.type != "cpu" and offload.device in ("cpu", "nvme")


def _norm_path(device: torch.device):
    """The step path whose norm a staged step uses: the one the device's
    step would use, without its warning about the update (which the C core
    runs here)."""
    if device.type == "cuda" and _kernels_unusable(device) is not None:
        return TorchStep(device)
    return step_path_for(device)


def step_path_for(device: torch.device):
    """The step for a model whose parameters are on `device`."""
    if device.type == "cpu":
        return HostStep()
    if device.type == "cuda":
        reason = _kernels_unusable(device)
        if reason is None:
            return CudaStep(device)
        # stacklevel: the user's initialize() call
        warn_user(f"zero's CUDA kernels cannot run here ({reason}); the optimizer step "
                  "runs as torch ops instead, which is slower", RuntimeWarning)
        return TorchStep(device)
    raise NotImplementedError(f"zero trains models on cpu or cuda devices, not {device.type}")


def _kernels_unusable(device):
    """None if zero's kernels run on `device`, else why not. cuda_available()
    opens the driver; only a launch loads the fatbin into the device's
    context, which is where a driver older than the nvcc that built it, or
    a GPU older than sm_80, is found."""
    import zero.step._cuda as _cuda
    if not _cuda.available():
        return _cuda.info()["reason"]
    try:
        with torch.cuda.device(device):
            _cuda.l2_norm([torch.zeros(1, device=device)])
    except (RuntimeError, ValueError) as error:  # the binding's two kinds of failure
        return str(error)
    return None

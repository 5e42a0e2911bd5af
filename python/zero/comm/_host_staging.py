"""Collectives on a group whose backend cannot carry the model's tensors:
each device tensor goes through a copy in host memory (issue 22 item 5).

[Note: host-staged collectives] NCCL refuses two ranks on one GPU, so
ranks that share a GPU (a one-GPU machine running 2 processes, to test the
multi-rank path) train over gloo, and gloo carries CUDA tensors for a few
collectives only (broadcast and all-reduce, through host copies of its
own), not for the reduce that zero's buckets use on gloo. There every
collective of a Comm is staged: the tensors it reads are copied
to host memory (pinned where CUDA is present, so the copies run at the
link's speed), the collective runs on the copies with gloo, and what it
wrote is copied back to the device tensor, at once for a blocking call or at
the handle's wait() for an async one (the caller may not read an async
result before its wait(), as with NCCL). The device-to-host copy is a
blocking one on the current stream: it waits for the kernels that wrote the
tensor, and the collective reads the copy, never the device tensor. Only
what a collective writes is copied back: the output of a gather or
reduce-scatter, the destination's tensor of a reduce, every receiver's of a
broadcast. comm_summary()'s "host_staged_bytes" counts the bytes copied
each way. This is a path for correctness, not speed: each collective
waits for the GPU once more than NCCL would. Tests force it on CPU tensors
(tests/distributed/test_host_staged_ranks.py) so its logic runs where no
GPU is; tests/gpu/test_shared_gpu_ranks.py runs it on one GPU."""
from __future__ import annotations

import os

import torch

from zero._warnings import warn_user
from zero.comm._handles import StagedWork, copy_back
from zero.comm._launcher_env import local_world_size


_warned = {"staged": False}  # warn_host_staged: once a process


def ranks_share_a_gpu() -> bool:
    """Whether this node runs more ranks (LOCAL_WORLD_SIZE, LOCAL_SIZE) than
    it has GPUs, so that some ranks share one. Not guessed when
    CUDA_VISIBLE_DEVICES is set: a launcher that gives each rank its own GPU
    (one visible device each, as SLURM's --gpus-per-task does) would look
    the same from inside one rank, and those ranks need NCCL. Ranks that
    share a GPU there make a gloo group themselves (docs/engine.md)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return False
    local = local_world_size()  # torchrun's or DeepSpeed's launcher's count
    return torch.cuda.is_available() and local > torch.cuda.device_count()


def warn_host_staged(backend: str):
    if not _warned["staged"]:
        _warned["staged"] = True
        why = " (ranks share a GPU here, which NCCL refuses)" if ranks_share_a_gpu() else ""
        warn_user(f"zero: the model is on a GPU and the process group's backend "
                  f"{backend!r} has no NCCL for its tensors{why}: each collective copies "
                  "them to host memory and runs on gloo, which is correct but slower than "
                  "NCCL (docs/engine.md, \"Ranks that share a GPU\")", RuntimeWarning)


def host_copy(tensor: torch.Tensor, with_values: bool = True) -> torch.Tensor:
    """A host tensor of `tensor`'s shape and dtype, holding its values when
    `with_values` (else uninitialised, for a collective to write)."""
    pin = tensor.device.type == "cuda"
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    if with_values:
        host.copy_(tensor)  # blocking: waits for the kernels that wrote it
    return host


def run_staged(comm, what: str, collective, args: tuple, reads: tuple, writes: tuple,
               **kwargs):
    """collective(*args, **kwargs) on `comm`'s group with the tensors at
    positions `reads` (read by the collective) and `writes` (written by it;
    both when in both) swapped for host copies; what the collective wrote
    is copied back to args[i] for i in `writes`, at once or, with
    async_op=True, at the returned handle's wait()."""
    staged = list(args)
    for i in set(reads) | set(writes):
        staged[i] = host_copy(args[i], with_values=i in reads)
    copies = [(args[i], staged[i]) for i in writes]
    comm.log.record_staged(sum(args[i].nbytes for i in (*reads, *writes)))
    work = comm._issue(what, collective, *staged, **kwargs)
    if kwargs.get("async_op"):
        return StagedWork(work, copies)
    copy_back(copies)
    return None

"""deepspeed.init_distributed on torch.distributed: the default process
group from the launcher's environment (torchrun, deepspeed's launcher), or
a one-process group when there is none (a plain `python train.py`)."""
from __future__ import annotations

import datetime
import os

import torch

from zero.comm._host_staging import ranks_share_a_gpu
from zero.comm._world import init_world_group, world_group_exists
from zero.deepspeed.utils._logging import logger


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=None, init_method=None,
                     dist_init_required=None, config=None, rank=-1, world_size=-1,
                     timeout_from="init_distributed(timeout=...)"):
    """Make torch.distributed's default group, as DeepSpeed's call does:
    nothing when one exists (dist_init_required=True too: DeepSpeed logs
    that the backend is initialized already and goes on); the backend NCCL where CUDA is
    available, else gloo, and gloo where ranks share a GPU (which NCCL
    refuses; zero stages their collectives through host memory). The
    timeout, when not given, is DeepSpeed's: DEEPSPEED_TIMEOUT minutes,
    else 30. Rank and world size come from rank=/world_size= or the
    launcher's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (timeout_from,
    ours: where a given timeout came from, for the error a collective that
    times out raises). MPI
    discovery (auto_mpi_discovery under mpirun) is not done: launch with
    torchrun or deepspeed's launcher, which set those variables."""
    if world_group_exists():
        # DeepSpeed's rule, dist_init_required=True included: the group there
        # is used (DeepSpeed-Chat calls init_distributed(), then initialize(...,
        # dist_init_required=True))
        if verbose and int(os.environ.get("RANK", "0")) == 0:
            logger.info("Distributed backend already initialized")
        return
    if dist_init_required is False:
        return
    gpus = torch.cuda.is_available() and not ranks_share_a_gpu()
    backend = dist_backend or ("nccl" if gpus else "gloo")
    if timeout is None:
        timeout = _deepspeed_timeout()
        source = ("DEEPSPEED_TIMEOUT (minutes)" if "DEEPSPEED_TIMEOUT" in os.environ else
                  "DeepSpeed's default, 30 minutes (DEEPSPEED_TIMEOUT changes it)")
    else:
        source = timeout_from
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
    init_world_group(backend, rank=rank, world_size=world_size, init_method=init_method,
                     port=distributed_port, timeout=timeout,
                     timeout_from=f"zero.deepspeed's init_distributed made it, the timeout "
                                  f"from {source}")


def _deepspeed_timeout() -> datetime.timedelta:
    """DeepSpeed's default process-group timeout: the DEEPSPEED_TIMEOUT
    environment variable in minutes, 30 when unset."""
    text = os.environ.get("DEEPSPEED_TIMEOUT", "30")
    try:
        minutes = int(text)
    except ValueError:
        raise ValueError(f"DEEPSPEED_TIMEOUT must be a whole number of minutes (DeepSpeed "
                         f"reads it so), got {text!r}") from None
    if minutes <= 0:
        raise ValueError(f"DEEPSPEED_TIMEOUT must be a positive number of minutes, got {text!r}")
    return datetime.timedelta(minutes=minutes)

"""The default process group made on a script's request (zero.deepspeed's
init_distributed), beside the one zero.initialize makes for itself
(_comm.join_process_group): the launcher's environment, or one process."""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from zero.comm._launcher_env import check_not_one_of_many


# how the default group zero.deepspeed made came by its timeout (for the
# timeout error: raise_if_timed_out in _comm.py); None for any other group
_made = {"timeout_from": None}


def world_group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


def deepspeed_group_timeout_source(group) -> str | None:
    """Where the timeout of `group` was set, when it is the default group
    zero.deepspeed's init_distributed made (else None)."""
    if _made["timeout_from"] is None or not world_group_exists():
        return None
    if group is None or group is dist.group.WORLD:
        return _made["timeout_from"]
    return None


def init_world_group(backend: str, rank: int = -1, world_size: int = -1, init_method=None,
                     port: int = 29500, timeout: datetime.timedelta | None = None,
                     timeout_from: str | None = None):
    """torch.distributed's default group: rank and world size given, else
    the launcher's RANK and WORLD_SIZE, else one process in memory (a
    plain script or a notebook). The caller's group then: engines reuse it
    and never destroy it. timeout_from: where `timeout` came from, for the
    error a timed-out collective raises."""
    _made["timeout_from"] = timeout_from
    env = os.environ
    if rank < 0 and "RANK" in env:
        rank = int(env["RANK"])
    if world_size < 0 and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
    kwargs = {} if timeout is None else {"timeout": timeout}
    if init_method is None and world_size in (-1, 1) and rank in (-1, 0) and \
            "MASTER_ADDR" not in env:
        if world_size == -1:  # nobody said how many: not one of mpirun's or srun's
            check_not_one_of_many()  # [Note: launcher environment]
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                **kwargs)
        return
    if rank < 0 or world_size < 1:
        raise ValueError(f"init_distributed: rank {rank} of world_size {world_size}: give "
                         "both, or launch with torchrun (which sets RANK and WORLD_SIZE)")
    if init_method is None:
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(port))
        init_method = "env://"
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, **kwargs)


def torch_distributed():
    """torch.distributed itself, for zero.deepspeed.comm: the collectives a
    DeepSpeed script makes on its own tensors (`from deepspeed import comm
    as dist`), which are the script's, not the engine's."""
    return dist

"""deepspeed.comm: the calls DeepSpeed scripts make (`from deepspeed import
comm as dist`; dist.get_rank(), dist.all_reduce(t), dist.barrier(), ...).
They are the script's own collectives on torch.distributed, as DeepSpeed's
are on its backend; DeepSpeed's profiling arguments (log_name, prof,
debug) are taken and ignored. log_summary() prints the totals of the
config's comms_logger (engine/_step_logs.py) for the engine that logged
last, on the rank that logs (global rank 0); elsewhere, and without a
comms_logger, nothing."""
from __future__ import annotations

import datetime
import functools
import os

from zero.comm._world import torch_distributed
from zero.deepspeed._distributed import init_distributed  # noqa: F401 (DeepSpeed's name)
from zero.engine._step_logs import latest_comms_logger

_dist = torch_distributed()
ReduceOp = _dist.ReduceOp
_PROFILING = ("log_name", "prof", "debug", "use_caller_name")


def _passed(name):
    call = getattr(_dist, name)

    @functools.wraps(call)
    def run(*args, **kwargs):
        for key in _PROFILING:
            kwargs.pop(key, None)
        return call(*args, **kwargs)
    return run


for _name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
              "reduce_scatter_tensor", "reduce_scatter", "reduce", "all_to_all_single",
              "all_to_all", "gather", "scatter", "send", "recv", "isend", "irecv", "barrier",
              "monitored_barrier", "new_group", "get_global_rank", "destroy_process_group",
              "is_available", "is_initialized", "get_backend"):
    globals()[_name] = _passed(_name)


def get_rank(group=None) -> int:
    """This process's rank (in `group`); 0 before any group exists, as a
    one-process run is rank 0."""
    return _dist.get_rank(group) if _dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return _dist.get_world_size(group) if _dist.is_initialized() else 1


def get_local_rank() -> int:
    """The launcher's LOCAL_RANK (0 without one), as DeepSpeed reads it."""
    return int(os.environ.get("LOCAL_RANK", 0))


def log_summary(show_straggler=False, return_dict=False):
    """The comms logger's table: per operation, calls, total MiB and MiB a
    step. show_straggler (DeepSpeed's per-rank latency spread) is accepted
    and not reported: zero counts bytes, not latencies. return_dict=True
    also returns {"summary": {operation: {"count", "total_bytes"}},
    "straggler_analysis": None, "metadata": {"world_size", "rank",
    "timestamp"}}: DeepSpeed's keys, with zero's counts under "summary"
    (DeepSpeed's holds latencies by message size)."""
    logger = latest_comms_logger()
    if logger is not None:
        logger.log_summary()
    if not return_dict:
        return None
    totals = logger.totals if logger is not None else {}
    return {"summary": {op: {"count": t["calls"], "total_bytes": t["bytes"]}
                        for op, t in sorted(totals.items())},
            "straggler_analysis": None,
            "metadata": {"world_size": get_world_size(), "rank": get_rank(),
                         "timestamp": datetime.datetime.now().isoformat()}}

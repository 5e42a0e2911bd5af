"""How many threads the C core runs: the user's choice, else, under a
launcher that starts several ranks on one machine, this rank's share of
the machine's cores.

Why: the pool defaults to every CPU the process may run on. With N ranks on
one machine (torchrun --nproc_per_node N) that is N pools of every core,
spinning against each other and against torch and the communication
threads; a GPU node's ranks all step their offloaded states at the same
moment. torchrun's OMP_NUM_THREADS=1 is not followed: it is a guard for
OpenMP runtimes, and one thread a rank would leave most cores of a GPU node
idle during an offloaded step.
"""
from __future__ import annotations

import os

import zero._C as _C
from zero.comm._launcher_env import local_world_size

_chosen = False  # set_num_threads was called: initialize leaves the count alone


def set_num_threads(n: int) -> None:
    """Threads the C core uses, the caller included; 0: every CPU this
    process may run on. A count set here is kept by zero.initialize, which
    otherwise gives each of a machine's ranks its share of the cores."""
    global _chosen
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n (the thread count) must be an int, got {type(n).__name__} {n!r}")
    _C.set_num_threads(n)
    _chosen = True


def share_cores_among_local_ranks() -> None:
    """Called by initialize: unless the user chose a count, a rank started
    beside others on its machine (LOCAL_WORLD_SIZE, or DeepSpeed's
    launcher's LOCAL_SIZE, > 1) uses its share of
    the CPUs, at least one. A rank the launcher already bound to fewer CPUs
    than the machine has keeps all of those."""
    if _chosen:
        return
    local_ranks = local_world_size()  # torchrun's or DeepSpeed's launcher's count
    if local_ranks <= 1:
        return
    usable = len(os.sched_getaffinity(0))
    if usable < (os.cpu_count() or usable):
        return  # bound by the launcher (numactl, --cpu-bind): its choice stands
    _C.set_num_threads(max(1, usable // local_ranks))

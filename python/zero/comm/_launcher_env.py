"""What the launcher's environment says about this process's place.

[Note: launcher environment] torchrun sets RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK and LOCAL_WORLD_SIZE; DeepSpeed's launcher the
same but LOCAL_SIZE for the ranks on this machine. zero joins the world
those name, or, with none of them, makes a world of this one process.
In between it refuses rather than guess, naming what is missing: a
process that is one of several (a RANK other than 0, or an MPI launcher
or srun that started several tasks) without the rest would train alone,
a world of one, while its siblings do the same, each writing the same
checkpoint files (WORLD_SIZE=1 says each trains alone, as a sweep's tasks
do). MPI and SLURM ranks are not discovered (docs/engine.md): their sizes
are read only to refuse. MASTER_ADDR or MASTER_PORT alone
(exported in a shell or a notebook) says nothing about other processes."""
from __future__ import annotations

import os

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# the task counts of launchers zero does not read ranks from: OpenMPI,
# MPICH/Intel MPI (PMI), MVAPICH, and srun's job step
_OTHER_LAUNCHERS = (("OMPI_COMM_WORLD_SIZE", "mpirun (OpenMPI)"), ("PMI_SIZE", "an MPI launcher"),
                    ("MV2_COMM_WORLD_SIZE", "mpirun (MVAPICH)"),
                    ("SLURM_STEP_NUM_TASKS", "srun"))


def launched() -> bool:
    """Whether torch's env:// rendezvous can run: every variable is set."""
    return all(v in os.environ for v in LAUNCHER_VARS)


def check_not_half_launched():
    """Called where no launcher variable set would make a world of one:
    refuses a process that is evidently one of several ([Note: launcher
    environment])."""
    present = [v for v in LAUNCHER_VARS if v in os.environ]
    missing = [v for v in LAUNCHER_VARS if v not in os.environ]
    if present and (os.environ.get("WORLD_SIZE", "1") != "1" or
                    os.environ.get("RANK", "0") != "0"):
        raise RuntimeError(
            f"launcher variables {', '.join(present)} are set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not; start with torchrun, set the missing "
            "ones, or unset them")
    check_not_one_of_many()


def check_not_one_of_many():
    """Refuses a process that an MPI launcher or srun started several of,
    where WORLD_SIZE does not say how many train together (WORLD_SIZE=1:
    each alone, as the tasks of a sweep are)."""
    if "WORLD_SIZE" in os.environ:
        return
    for name, launcher in _OTHER_LAUNCHERS:
        count = _count(name)
        if count > 1:
            raise RuntimeError(
                f"this process is one of {count} that {launcher} started ({name}={count}), but "
                "the variables torch's rendezvous needs (RANK, WORLD_SIZE, MASTER_ADDR, "
                "MASTER_PORT) are not set, so each would train alone as a world of one. zero "
                "does not read ranks from MPI or SLURM: start the processes with torchrun (or "
                "DeepSpeed's launcher), or export the four in each (for srun: "
                "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID, "
                "MASTER_ADDR the first node's host name, MASTER_PORT a free port); to train "
                "each process alone (a sweep), export WORLD_SIZE=1")


def local_world_size() -> int:
    """Ranks on this machine: torchrun's LOCAL_WORLD_SIZE, else DeepSpeed's
    launcher's LOCAL_SIZE, else 1. A value that is not a count reads as 1
    (not ours to validate: the launcher set it)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if name in os.environ:
            return max(1, _count(name))
    return 1


def _count(name) -> int:
    try:
        return int(os.environ.get(name, "1"))
    except ValueError:
        return 1

"""Run a function in `world` real processes on gloo and collect what each
rank returns. Tests spawn once per module and run all their scenarios in
that one launch: starting a process that imports torch costs seconds here."""
from __future__ import annotations

import importlib.util
import os
import pickle
import random
import socket
import tempfile
import time
import traceback

import multiprocessing

import torch.multiprocessing as mp

# launches whose rendezvous port was taken before rank 0 listened on it
PORT_ATTEMPTS = 3

# Workers are forked from a server process that imported these once
# (multiprocessing's forkserver), not spawned to import them again: about
# 1.5 s of CPU a worker (torch, and torch.optim's first param group imports
# torch._dynamo), some 250 workers a suite on 2 cores. The server is a
# fresh interpreter with nothing of the test process's state: no process
# group, no CUDA, no parallel op run (numpy's OpenBLAS threads, started by
# the imports, handle a fork themselves). It starts at the first launch
# and keeps the environment of then: a worker sees an os.environ change
# made after that only if the test passes it in its arguments.
multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "zero"])


def _forkserver_imports_this_zero():
    """Python 3.11's forkserver imports its preload with the sys.path of a
    fresh interpreter, not the test process's: run from another checkout
    (a worktree, a bench's "before" tree that puts its python/ first), the
    workers got the installed zero, silently. The server inherits
    os.environ when it starts, so PYTHONPATH names this process's zero
    first (subprocesses a test starts get the same zero)."""
    spec = importlib.util.find_spec("zero")
    if spec is None or spec.origin is None:
        return
    root = os.path.dirname(os.path.dirname(spec.origin))
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + rest)


_forkserver_imports_this_zero()


def free_port() -> int:
    """A port free now for a rendezvous, outside the kernel's ephemeral
    range. One the kernel handed out (bind to 0) goes back to that range
    when closed, where any outgoing connection may take it before rank 0
    listens (gloo opens many: a run beside another CI run failed with
    EADDRINUSE that way)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.randrange(10000, max(10001, ephemeral_low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        error = None
    except BaseException:
        result, error = None, traceback.format_exc()
    # whole or not at all: when a peer fails, spawn ends this rank with
    # SIGTERM, maybe in the middle of the dump, and a half-written file
    # read as this rank's answer raised EOFError instead of the peer's error
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump((result, error), f)
    os.replace(path + ".part", path)
    if error:
        raise SystemExit(1)


def _join_all(ctx, timeout):
    """True once every worker has ended; False at the deadline. join()
    returns as each process ends, so it is called until all have."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            return True
    return False


def run(world: int, fn, *args, timeout: float = 300):
    """[rank0 result, rank1 result, ...]; raises with the worker's traceback,
    or when the workers are not done within `timeout` seconds (a hang must
    fail the test, not stall the suite). A launch whose rendezvous port was
    taken by another process before rank 0 listened on it (the workers ran
    nothing yet) is made again on another port."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _run_once(world, fn, args, timeout)
        except RuntimeError as error:
            if "EADDRINUSE" not in str(error) or attempt == PORT_ATTEMPTS - 1:
                raise


def _run_once(world, fn, args, timeout):
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), out_dir, fn, args),
                                 nprocs=world, join=False, start_method="forkserver")
        try:
            if not _join_all(ctx, timeout):
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} workers still running after {timeout} s")
        except TimeoutError:
            raise
        except Exception as exited:  # torch's ProcessExitedException names the rank and signal
            errors, finished = [], []
            for r in range(world):
                path = os.path.join(out_dir, f"rank{r}.pkl")
                if os.path.exists(path):
                    finished.append(r)
                    with open(path, "rb") as f:
                        _, err = pickle.load(f)
                    if err:
                        errors.append(f"rank {r}:\n{err}")
            raise RuntimeError("\n".join(errors) or f"a worker failed: {exited} (ranks {finished} had returned)") from None
        results = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f)[0])
        return results

"""A save killed at each of its boundaries (tests/test_checkpoint_crashes.py).

A small engine trains, saves checkpoint A into tag "t" (which `latest` then
names), trains one more step (state B), and saves into "t" again, with the
process killed by SIGKILL at its N-th boundary of that second save: before
each fsync, rename, directory creation or removal, and in the middle of
each file's writing (at its second write). Whatever N, the checkpoint
directory must then load as A or as B, never fail.

    python crash_save_worker.py sweep DIR     one process: for N = 1, 2, ...
        a forked child saves and is killed at its N-th boundary; this
        process (never killed) checks what loads, until a child saves whole.
        Prints one JSON line per N.
    python crash_save_worker.py ranks DIR KILL_RANK PORTS
        one rank of two (RANK, WORLD_SIZE, MASTER_ADDR set by the test):
        for N = 0, 1, ... (one port of the comma-separated PORTS each), a
        forked child joins a new process group with the other rank's child,
        prepares DIR/nN/ck and saves; rank KILL_RANK's child is killed at
        its N-th boundary (N = 0: none, to count them). This process
        imports torch and zero once and never joins a group itself, so
        each child starts clean. Prints one JSON line per N; the test
        checks the directories.

A and B's model state dicts are written beside DIR as A.pt and B.pt.
"""
import json
import os
import shutil
import signal
import sys

import torch
from torch import nn

import zero
from zero.checkpoint import _writes as _checkpoint_writes
from zero.checkpoint import consolidate


def build(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return zero.initialize(model, optimizer=optimizer, stage=2)


def train_step(engine, i):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    engine.backward((engine(x) - y).square().mean())
    engine.step()


class Boundaries:
    """Counts the save's boundaries and kills this process at the n-th."""

    def __init__(self):
        self.count, self.kill_at = 0, None

    def cross(self):
        self.count += 1
        if self.count == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(self, owner, name):
        real = getattr(owner, name)

        def crossing(*args, **kwargs):
            self.cross()
            return real(*args, **kwargs)
        setattr(owner, name, crossing)

    def install(self):
        for name in ("fsync", "replace", "rename", "makedirs"):
            self.wrap(os, name)
        self.wrap(shutil, "rmtree")
        real_write = _checkpoint_writes._RecordingFile.write

        def write(file, data):
            file.writes = getattr(file, "writes", 0) + 1
            if file.writes == 2:  # the file half written
                self.cross()
            return real_write(file, data)
        _checkpoint_writes._RecordingFile.write = write


def prepare(directory):
    """Checkpoint A in tag "t", the engine then at state B; A.pt and B.pt
    beside the directory (rank 0)."""
    engine = build()
    for i in range(2):
        train_step(engine, i)
    engine.save_checkpoint(directory, tag="t")
    train_step(engine, 2)
    b = engine.full_state_dict()
    if engine._comm.rank == 0:
        parent = os.path.dirname(os.path.abspath(directory))
        torch.save(consolidate(directory)["model"], os.path.join(parent, "A.pt"))
        torch.save(b, os.path.join(parent, "B.pt"))
    return engine


def which(directory, a, b, tag=None):
    """"A" or "B": what the checkpoint directory (its `tag`, default the
    latest) loads as (consolidate, read-only); the error's text if it does
    not load."""
    try:
        model = consolidate(directory, tag)["model"]
    except Exception as error:  # noqa: BLE001 - reported to the test
        return f"error: {error}"
    for name, reference in (("A", a), ("B", b)):
        if model.keys() == reference.keys() and \
                all(torch.equal(model[k], reference[k].float()) for k in model):
            return name
    return "neither"


def leftovers(directory):
    return sorted(os.path.relpath(os.path.join(root, f), directory)
                  for root, dirs, files in os.walk(directory)
                  for f in files + dirs if f.endswith(".tmp"))


def sweep(directory):
    engine = prepare(directory)
    parent = os.path.dirname(os.path.abspath(directory))
    a, b = (torch.load(os.path.join(parent, f"{x}.pt")) for x in "AB")
    pristine = os.path.join(parent, "pristine")
    shutil.copytree(directory, pristine)
    loader = build(seed=7)
    boundaries = Boundaries()
    boundaries.install()
    for n in range(1, 200):
        shutil.rmtree(directory)
        shutil.copytree(pristine, directory)
        pid = os.fork()
        if pid == 0:
            boundaries.count, boundaries.kill_at = 0, n
            engine.save_checkpoint(directory, tag="t")
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        read = which(directory, a, b)
        left = leftovers(directory)
        loader.load_checkpoint(directory)  # reads only
        loaded = loader.full_state_dict()
        loaded_as = [name for name, ref in (("A", a), ("B", b))
                     if all(torch.equal(loaded[k], ref[k]) for k in ref)]
        left_by_load = leftovers(directory)
        loader.save_checkpoint(directory, tag="next")  # puts right what the kill left
        print(json.dumps({"n": n, "killed": killed, "exit": status, "read": read,
                          "leftovers_after_kill": left, "loaded": loaded_as,
                          "leftovers_after_load": left_by_load,
                          "leftovers_after_next_save": leftovers(directory),
                          "read_after_next_save": which(directory, a, b, "t")}), flush=True)
        if not killed:
            break


def ranks(base, kill_rank, ports):
    rank = int(os.environ["RANK"])
    boundaries = Boundaries()
    boundaries.install()
    for n, port in enumerate(ports):
        os.environ["MASTER_PORT"] = str(port)
        directory = os.path.join(base, f"n{n}", "ck")
        pid = os.fork()
        if pid == 0:
            engine = prepare(directory)
            boundaries.count = 0
            if rank == kill_rank:
                boundaries.kill_at = n
            engine.save_checkpoint(directory, tag="t")
            print(json.dumps({"n": n, "rank": rank, "boundaries": boundaries.count}),
                  flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"n": n, "rank": rank, "status": status,
                          "killed": os.WIFSIGNALED(status) and
                          os.WTERMSIG(status) == signal.SIGKILL}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "sweep":
        sweep(sys.argv[2])
    else:
        ranks(sys.argv[2], int(sys.argv[3]), [int(p) for p in sys.argv[4].split(",")])

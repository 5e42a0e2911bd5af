"""A save on 2 ranks, one rank killed at each of its boundaries: the other
rank ends with an error instead of waiting (unless the kill came after the
save was agreed whole), and the checkpoint directory loads as the
checkpoint before the save (A) or the one it wrote (B), never fails; the
next save removes what the kill left. tests/crash_save_worker.py does the
killing (one forked pair of ranks per boundary, each pair its own process
group); test_checkpoint_crashes.py sweeps one process the same way."""
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from crash_save_worker import build, leftovers, which  # noqa: E402
from harness import free_port  # noqa: E402
from test_checkpoint_crashes import WORKER, worker_env  # noqa: E402

MOST_BOUNDARIES = 40  # a save crosses ~19 on rank 0; the sweep stops past the last


def distinct_ports(count, taken):
    """count free ports, none in `taken` (which gets them): two sweeps
    running at once must not share a rendezvous port."""
    ports = []
    while len(ports) < count:
        port = free_port()
        if port not in taken:
            taken.add(port)
            ports.append(port)
    return ports


def start_sweep(base, kill_rank, count, taken=None):
    """The two ranks' processes of a sweep over N = 0 .. count - 1 (N = 0:
    nobody killed), started: (processes, their output files). taken: ports
    another sweep running at once holds."""
    ports = ",".join(str(p) for p in distinct_ports(count, set() if taken is None else taken))
    procs, logs = [], []
    for rank in range(2):
        env = dict(worker_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1")
        # files, not pipes: a survivor's error report each round would fill
        # an unread pipe and stop that rank (and so its peer) for good
        out, err = (open(os.path.join(base, f"rank{rank}.{x}"), "w+") for x in ("out", "err"))
        logs.append((out, err))
        procs.append(subprocess.Popen([sys.executable, WORKER, "ranks", str(base),
                                       str(kill_rank), ports], env=env, text=True,
                                      stdout=out, stderr=err))
    return procs, logs


def finish_sweep(procs, logs):
    """Each rank's JSON lines of a started sweep, once it ended."""
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        outputs.append((out.read(), err.read()))
        out.close()
        err.close()
    assert all(p.returncode == 0 for p in procs), [e[-3000:] for _o, e in outputs]
    return [[json.loads(line) for line in o.splitlines()] for o, _e in outputs]


def sweep(base, kill_rank, count):
    """Each rank's JSON lines for N = 0 .. count - 1 (N = 0: nobody killed)."""
    return finish_sweep(*start_sweep(base, kill_rank, count))


@pytest.fixture(scope="module")
def boundaries(tmp_path_factory):
    """Each rank's count of boundaries in the save (nobody killed)."""
    lines = sweep(tmp_path_factory.mktemp("whole"), kill_rank=-1, count=1)
    return [next(line["boundaries"] for line in rank_lines if "boundaries" in line)
            for rank_lines in lines]


def test_each_rank_crosses_boundaries(boundaries):
    # rank 0: the staging directory, its shard, the meta, the publish,
    # latest; rank 1: its shard (half written, fsync, rename, fsync)
    assert boundaries[0] >= 15 and boundaries[1] >= 4


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, boundaries):
    """{kill_rank: (its directory, each rank's JSON lines)}: the two sweeps
    run at once (two pairs of processes: each pair waits on itself half
    the time), about 1.4x faster than one after the other."""
    started, taken = {}, set()
    for kill_rank in (0, 1):
        base = tmp_path_factory.mktemp(f"kill{kill_rank}")
        started[kill_rank] = base, start_sweep(base, kill_rank, boundaries[kill_rank] + 1,
                                               taken)
    return {kill_rank: (base, finish_sweep(*run)) for kill_rank, (base, run) in started.items()}


@pytest.mark.parametrize("kill_rank", [0, 1])
def test_a_rank_killed_at_any_boundary_leaves_a_loadable_checkpoint(sweeps, boundaries,
                                                                   kill_rank, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)  # the loader below is one process
    count = boundaries[kill_rank]
    tmp_path, lines = sweeps[kill_rank]
    ended = [{line["n"]: line for line in rank_lines if "status" in line}
             for rank_lines in lines]
    loader = build(seed=7)
    outcomes = []
    for n in range(1, count + 1):
        assert ended[kill_rank][n]["killed"], (n, ended[kill_rank][n])
        directory = tmp_path / f"n{n}" / "ck"
        a, b = (torch.load(directory.parent / f"{x}.pt") for x in "AB")
        read = which(directory, a, b)
        assert read in ("A", "B"), (n, read)
        # the survivor ends with an error, not a hang (the sweep's
        # deadline), unless the save was agreed whole before the kill
        survivor = ended[1 - kill_rank][n]
        assert not survivor["killed"], (n, survivor)
        assert survivor["status"] != 0 or read == "B", (n, survivor)
        loader.load_checkpoint(directory)
        loaded = loader.full_state_dict()
        assert all(torch.equal(loaded[k], (a if read == "A" else b)[k].float()) for k in loaded)
        loader.save_checkpoint(directory, tag="next")  # puts right what the kill left
        assert leftovers(directory) == [], (n, leftovers(directory))
        assert which(directory, a, b, "t") == read, n
        outcomes.append(read)
    # a rank 1 kill is always before the publish; rank 0's last ones after
    assert outcomes[0] == "A"
    assert outcomes[-1] == ("B" if kill_rank == 0 else "A")
    loader.close()

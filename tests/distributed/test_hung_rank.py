"""A rank that stops (SIGSTOP: a process that hangs without ending, as a
deadlocked data loader or a frozen node does) ends its peer within the
timeout, with an error that names it and where it is set. Before, zero
made its group with torch's gloo default, 30 minutes, and a peer of a
stopped rank waited that long; torchrun, whose ranks were all alive,
noticed nothing.

Two real processes per case, started here from this file (not through
harness.run, whose join would wait on the stopped rank), both killed at
the end whatever happened."""
import os
import signal
import subprocess
import sys
import time

import pytest

import harness

TIMEOUT = 3.0  # seconds
STOP_AT_STEP = 3


def _worker(made_by: str):
    """One rank: train a few steps at stage 2; rank 1 stops itself in the
    middle. made_by "zero": zero makes the group from env://, with
    timeout=TIMEOUT; "user": the script makes it with that timeout and
    zero's setting is left out, so zero's channels take the group's;
    "deepspeed": zero.deepspeed.initialize makes it, with the config's
    comms_timeout."""
    import datetime

    import torch
    import torch.distributed as dist

    import zero
    from zero.comm import _comm
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if made_by == "user":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
        engine = zero.initialize(model, stage=2)
    elif made_by == "deepspeed":
        # DeepSpeed's initialize makes the default group itself: the config's
        # comms_timeout is its timeout, not DEEPSPEED_TIMEOUT's 30 minutes
        import zero.deepspeed as deepspeed
        engine, *_ = deepspeed.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 4, "comms_timeout": TIMEOUT,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    else:
        engine = zero.initialize(model, stage=2, timeout=TIMEOUT)
    channel = _comm.all_channels()[0]
    print(f"channel timeout {_comm.group_timeout(channel).total_seconds()}", flush=True)
    for step in range(2 * STOP_AT_STEP):
        if step == STOP_AT_STEP and rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
    print("finished", flush=True)


def _state(pid: int) -> str:
    """The process's state letter from /proc ("T": stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.serial  # TIMEOUT: a rank held up seconds by a loaded machine would trip it
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("made_by", ["zero", "user", "deepspeed"])
def test_a_stopped_rank_ends_its_peer_within_the_timeout(made_by, tmp_path):
    port = harness.free_port()
    procs, logs = [], []
    try:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            out = open(tmp_path / f"rank{rank}.out", "w")
            err = open(tmp_path / f"rank{rank}.err", "w")
            logs += [out, err]
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), made_by],
                                          env=env, stdout=out, stderr=err))
        deadline = time.monotonic() + 120
        while procs[1].poll() is None and _state(procs[1].pid) != "T":
            assert time.monotonic() < deadline, "rank 1 never reached its stop"
            time.sleep(0.02)
        stopped = time.monotonic()
        procs[0].wait(timeout=TIMEOUT + 60)
        waited = time.monotonic() - stopped
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
            p.wait()
        for f in logs:
            f.close()
    out, err = ((tmp_path / f"rank0.{kind}").read_text() for kind in ("out", "err"))
    assert procs[1].returncode == -signal.SIGKILL, "rank 1 ended before it was stopped"
    assert procs[0].returncode == 1, err[-3000:]
    # zero's channels have the timeout: zero's setting, or the user's group's
    assert f"channel timeout {TIMEOUT}" in out
    assert "finished" not in out
    assert f"timed out: another rank did not join it within {TIMEOUT:g} s (the process " \
        "group's timeout)" in err, err[-3000:]
    if made_by == "zero":
        assert f"zero's `timeout` setting (set to {TIMEOUT:g} s)" in err
    elif made_by == "deepspeed":
        assert "zero.deepspeed's init_distributed made it, the timeout from " \
            "\"comms_timeout\" in the config" in err, err[-3000:]
    else:  # the user's group, or zero's channels beside it
        assert "dist.init_process_group(timeout=...)" in err or \
            "take the timeout of the default process group your code made" in err
    # the configured time, plus the exit: 30 minutes before
    assert waited < TIMEOUT + 20


if __name__ == "__main__":
    _worker(sys.argv[1])

"""Finished 2-rank runs on a process group the script made exit 0.

zero's exit hook ([Note: gloo at exit] in _comm.py: release the GIL a
moment, so gloo's worker threads drop their last tensors before the
interpreter finalizes) ran only when zero had made the group; on a group
made by the script (or by accelerate under the HF Trainer) about 1 run in 4
at stages 2 and 3 aborted at exit under torchrun: "terminate called
without an active exception", exit -6 (docs/engine.md, "Finished runs exit
0"). The abort comes when a gloo worker thread gets the CPU only after the
main thread has begun finalizing, as on a busy machine. Each worker here
makes that likely: its threads share one CPU, gloo's at the lowest
priority (nice 19), and the GIL is handed over every 50 ms rather than
5 ms. Without the hook 12 of 20 such processes aborted at stage 2 and 8 of
20 at stage 3 (10 runs each), so a few runs are enough to see it; with it,
none of 50 and 30: the hook's sleep lets gloo's threads run before
finalization whatever their priority.

Real processes, started here from this file (torchrun would add seconds
per run), killed at the end whatever happened."""
import os
import subprocess
import sys
import threading

import pytest

import harness

RUNS = 2


def _worker(stage: int):
    import torch
    import torch.distributed as dist

    import zero
    cpus = sorted(os.sched_getaffinity(0))
    # before gloo starts its threads, which inherit it
    os.sched_setaffinity(0, {cpus[int(os.environ["RANK"]) % len(cpus)]})
    sys.setswitchinterval(0.05)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    engine = zero.initialize(model, stage=stage)
    main = threading.get_native_id()
    for task in os.listdir("/proc/self/task"):  # gloo's threads, and torch's
        if int(task) != main:
            os.setpriority(os.PRIO_PROCESS, int(task), 19)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
    # and nothing else: the script ends right after the last step's gather


def _start(stage: int) -> list:
    port = harness.free_port()
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(stage)],
                             env=dict(os.environ, RANK=str(rank), WORLD_SIZE="2",
                                      LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for rank in range(2)]


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="per-thread priorities and /proc/self/task")
@pytest.mark.parametrize("stage", [2, 3])
def test_finished_runs_on_the_users_group_exit_0(stage):
    failed = []
    for run in range(RUNS):
        procs = _start(stage)
        try:
            for rank, p in enumerate(procs):
                _, err = p.communicate(timeout=120)
                if p.returncode != 0:
                    failed.append(f"run {run} rank {rank}: exit {p.returncode}: {err[-500:]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    assert not failed, "\n".join(failed)


if __name__ == "__main__":
    _worker(int(sys.argv[1]))

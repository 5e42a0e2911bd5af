"""Optimizer offload to a disk (offload_optimizer device "nvme"): the step's
time with the fp32 master and the AdamW states in RAM, in mapped files
served by the page cache, and in files written through to the disk every
step, beside the disk's own bandwidth measured in the same run.

The model is a stack of bias-free square Linear layers (--params in
all), trained in bf16 at stage 3 (DeepSpeed offloads optimizer states to
NVMe at stage 3 only) in one process: the files hold the fp32 master and
two moments, 12 bytes a parameter, and a step reads and writes them all.
The disk limit of a disk-bound step is the time to read those bytes cold
plus the time to write and fsync them, with plain file calls on a file of
that size in the same directory: through the page cache (read with it
emptied first) and with O_DIRECT in 16 MiB calls, each direction taken
from the faster of the two (the fastest of 3 rounds before the runners
and 3 after). "of disk limit" divides it by the median iteration
(forward, backward and step); "step of limit" by the median step alone.

Each runner is a fresh process (its resident-memory peak is its own):
it trains two warm-up steps, then --steps more, and reports the median
step and iteration times and the peak RSS of those steps above the process
before the model existed. DeepSpeed's NVMe offload needs its async_io op,
which it compiles at first use (about 5 minutes here) and which needs
libaio-dev (`apt-get install libaio-dev`); the table says why it cannot
run where it cannot.

The write_through_threads runner is write_through with the C core's
thread backend for the disk I/O instead of io_uring; write_through_direct
reads and writes the files with O_DIRECT instead of through the page
cache; write_through_delayed is write_through with
offload_optimizer.delayed_update, whose step's disk reads and writes run
during the next forward and backward (its "step" is what step() waits
for: the rest of the previous update, and starting the next).

Usage: python bench/offload.py [--params 64M] [--steps 8] [--dir /tmp/zero-offload-bench]
       [--runners ram,nvme,write_through,write_through_threads,write_through_direct,
                  write_through_delayed,ds_nvme] [--io 32:1[:direct]]
       [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _results import write_json

HIDDEN = 4096
CHUNK = int(os.environ.get("ZERO_BENCH_CHUNK", 1 << 22))  # offload_optimizer.chunk_elements
BATCH = 8
RUNNERS = {
    "ram": "zero, states in RAM",
    "nvme": "zero nvme, page cache",
    "write_through": "zero nvme, write_through",
    "write_through_threads": "zero write_through, threads",
    "write_through_direct": "zero write_through, O_DIRECT",
    "write_through_delayed": "zero write_through, delayed update",
    "ds_nvme": "DeepSpeed nvme offload",
}


def parse_size(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024


def _model(params):
    import torch
    layers = _model_params(params) // HIDDEN**2
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
                                 for _ in range(layers)])


def worker(key, params, steps, directory, io=None):
    """One runner in this process; prints its result as JSON."""
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    if io or key in ("write_through_threads", "write_through_direct"):
        # the C core's disk I/O engine: queue depth, block size (MiB), direct
        from zero.offload._aio import set_io
        depth, block, *direct = (io or "32:1").split(":")
        set_io(queue_depth=int(depth), block_size=int(float(block) * 2**20),
               direct=direct == ["direct"] or key == "write_through_direct",
               backend="threads" if key == "write_through_threads" else None)
    base = _status("VmRSS")
    model = _model(params)
    x = torch.randn(BATCH, HIDDEN)
    if key == "ds_nvme":
        step, files = _deepspeed(model, directory), []
    else:
        step, files = _zero(key, model, directory)
    step(x)  # warm-up: the states exist and have been written once
    step(x)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak from here on
    steps_s, iterations_s = [], []
    for _ in range(steps):
        start = time.perf_counter()
        steps_s.append(step(x))
        iterations_s.append(time.perf_counter() - start)
    io = None
    try:  # (zero before its C disk I/O engine has none to report)
        from zero.offload._aio import io_info
        io = io_info() if key != "ds_nvme" else None
    except ImportError:
        pass
    print(json.dumps(dict(io=io, step_s=statistics.median(steps_s),
                          iteration_s=statistics.median(iterations_s),
                          peak_rss=_status("VmHWM") - base,
                          file_bytes=sum(f.nbytes for f in files))))


def _zero(key, model, directory):
    import zero
    import torch
    options = {}
    if key != "ram":
        options["offload_optimizer"] = {"device": "nvme", "nvme_path": directory,
                                        "write_through": key.startswith("write_through"),
                                        "chunk_elements": CHUNK,
                                        "delayed_update": key.endswith("_delayed")}
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                             stage=3, precision="bf16", **options)
    files = [fg.offload for fg in engine.groups if fg.offload is not None]

    def step(x):
        engine.backward(engine(x).float().square().mean())
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start
    return step, files


def _deepspeed(model, directory):
    import torch
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    config = {"train_micro_batch_size_per_gpu": BATCH, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {
                  "device": "nvme", "nvme_path": directory}}}
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)

    def step(x):
        engine.backward(engine(x.to(torch.bfloat16)).float().square().mean())
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start
    return step


def disk_limit(directory, nbytes, repeat=3):
    """The fastest of `repeat` rounds of _disk_round, for each direction
    the faster of buffered and O_DIRECT calls."""
    rounds = [_disk_round(directory, nbytes, direct) for _ in range(repeat)
              for direct in (False, True)]
    rounds = [r for r in rounds if r is not None]
    return dict(write_s=min(r["write_s"] for r in rounds),
                read_s=min(r["read_s"] for r in rounds), bytes=rounds[0]["bytes"],
                **{f"{way}_{what}_s": min(r[f"{what}_s"] for r in rounds if r["way"] == way)
                   for way in {r["way"] for r in rounds} for what in ("write", "read")})


def _disk_round(directory, nbytes, direct=False):
    """Seconds to write+fsync nbytes to a new file in `directory`, and to
    read them back with the page cache emptied of it first; with direct,
    through an O_DIRECT descriptor in 16 MiB calls (None where the
    filesystem refuses O_DIRECT)."""
    piece = 16 << 20 if direct else 1 << 20
    payload = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
    payload.write(os.urandom(1 << 20) * (piece >> 20))
    count = max(1, nbytes // piece)
    fd, path = tempfile.mkstemp(dir=directory, suffix=".bin")
    try:
        if direct:
            try:
                direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError:
                return None
            os.close(fd)
            fd = direct_fd
        start = time.perf_counter()
        for i in range(count):
            os.pwritev(fd, [payload], i * piece)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for i in range(count):
            if os.preadv(fd, [payload], i * piece) <= 0:
                break
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.remove(path)
    return dict(write_s=write_s, read_s=read_s, bytes=count * piece,
                way="direct" if direct else "buffered")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="64M")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dir", default="/tmp/zero-offload-bench")
    ap.add_argument("--runners", default=",".join(RUNNERS))
    ap.add_argument("--io", help="queue_depth:block_MiB[:direct] of zero's disk I/O "
                                 "engine (default 32:1, buffered)")
    ap.add_argument("--json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    params = parse_size(args.params)
    if args.worker:
        return worker(args.worker, params, args.steps, args.dir, args.io)
    real = _model_params(params)
    # the disk before and after the runners, the fastest rounds of both:
    # its bandwidth here varies by up to 2x between minutes
    disk = [disk_limit(args.dir, 12 * real)]
    rows = {}
    for key in args.runners.split(","):
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", key,
                               "--params", args.params, "--steps", str(args.steps),
                               "--dir", args.dir, *(["--io", args.io] if args.io else [])],
                              capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            rows[key] = dict(json.loads(lines[-1]), ok=True)
        else:
            tail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()
            rows[key] = dict(ok=False, reason=tail[-1][:160])
        print(f"  ran {RUNNERS[key]}: " + ("ok" if rows[key]["ok"] else rows[key]["reason"]),
              flush=True)
    disk.append(disk_limit(args.dir, 12 * real))
    disk = {key: min(d[key] for d in disk if key in d)
            for key in disk[0] if key.endswith("_s")} | dict(bytes=disk[0]["bytes"])
    print_table(rows, disk, real, args)
    if args.json:
        write_json(args.json, dict(rows=rows, disk=disk, params=real))


def _model_params(params):
    """The parameters of _model(params): whole square layers, at least one."""
    return max(1, round(params / HIDDEN**2)) * HIDDEN**2


def print_table(rows, disk, params, args):
    state_bytes = 12 * params  # fp32 master, exp_avg, exp_avg_sq
    mib = 2**20
    read_bw, write_bw = disk["bytes"] / disk["read_s"], disk["bytes"] / disk["write_s"]
    limit_s = state_bytes / read_bw + state_bytes / write_bw
    print(f"\n{params / 1e6:.0f}M parameters, bf16 AdamW, stage 3, 1 process; states "
          f"{state_bytes / mib:,.0f} MiB; median of {args.steps} steps; files in {args.dir}")
    print(f"disk: write+fsync {write_bw / mib:,.0f} MiB/s, cold read {read_bw / mib:,.0f} "
          f"MiB/s -> reading and writing the states takes {limit_s:.3f} s")
    for way in ("buffered", "direct"):
        if f"{way}_write_s" in disk:
            print(f"  {way}: write+fsync {disk['bytes'] / disk[way + '_write_s'] / mib:,.0f} "
                  f"MiB/s, cold read {disk['bytes'] / disk[way + '_read_s'] / mib:,.0f} MiB/s")
    ios = {f"{r['io']['active']} qd {r['io']['queue_depth']} block "
           f"{r['io']['block_size'] >> 10} KiB{' O_DIRECT' if r['io']['direct'] else ''}"
           for key, r in rows.items() if r["ok"] and r.get("io") and key != "ram"}
    if ios:
        print("zero's disk I/O: " + "; ".join(sorted(ios)))
    print(f"{'':<36}{'step s':>9}{'iteration s':>13}{'peak RSS MiB':>14}"
          f"{'of disk limit':>15}{'step of limit':>15}")
    for key, row in rows.items():
        if not row["ok"]:
            print(f"{RUNNERS[key]:<36}  could not run: {row['reason']}")
            continue
        # the disk-bound runners: the states' bytes through the disk over
        # the whole iteration (forward and backward included), and over
        # the step alone
        bound = key.startswith("write_through") or key == "ds_nvme"
        of_limit = f"{limit_s / row['iteration_s']:>14.0%}" if bound else f"{'-':>14}"
        step_of = f"{limit_s / row['step_s']:>14.0%}" if bound else f"{'-':>14}"
        print(f"{RUNNERS[key]:<36}{row['step_s']:>9.3f}{row['iteration_s']:>13.3f}"
              f"{row['peak_rss'] / mib:>14,.0f} {of_limit} {step_of}")


if __name__ == "__main__":
    main()

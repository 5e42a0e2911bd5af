"""All-gather on gloo (CPU ranks): what zero's stage 3 and its parameter
refresh after each step use (one broadcast per rank straight into the
output's slices, [Note: gathers on gloo] in python/zero/_comm.py) beside
torch's two all-gathers, measured in the same run: time, and the peak
memory the call adds above the output it fills (VmHWM, with the output
already resident). A memcpy of the output's size is the floor: every byte
of the output is written once.

Usage: python bench/gather.py [--world 2] [--repeat 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))

import harness  # noqa: E402  the tests' launcher of real gloo processes

from _results import write_json

SIZES = [1 << 18, 1 << 22, 1 << 24]  # fp32 elements of the gathered output


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measure(call, repeat):
    """(fastest seconds, most bytes added above the resident set)."""
    best, extra = float("inf"), 0
    for _ in range(repeat):
        dist.barrier()
        base = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
        extra = max(extra, _status("VmHWM") - base)
    return best, extra


def _run(rank, world, repeat):
    from zero.comm._comm import all_gather_single, gather_by_broadcasts
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for n in SIZES:
        shard = torch.full((n // world,), float(rank))
        out = torch.zeros(n)  # resident before any call
        copy_from = torch.ones(n)
        ways = {
            "memcpy of the output (floor)": lambda: out.copy_(copy_from),
            "zero: a broadcast per rank": lambda: gather_by_broadcasts(out, shard, rank, world),
            "torch all_gather_into_tensor": lambda: all_gather_single(out, shard),
            "torch all_gather (list of views)":
                lambda: dist.all_gather(list(out.view(world, -1)), shard),
        }
        for name, call in ways.items():
            seconds, extra = _measure(call, repeat)
            expected = torch.arange(world, dtype=torch.float32).repeat_interleave(n // world)
            ok = name.startswith("memcpy") or torch.equal(out, expected)
            rows.append({"elements": n, "way": name, "seconds": seconds,
                         "extra_bytes": extra, "ok": ok})
    dist.destroy_process_group()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed memory leaves at once
    rows = harness.run(args.world, _run, args.repeat, timeout=600)[0]
    print(f"all-gather of fp32 outputs on {args.world} gloo ranks (rank 0; fastest of "
          f"{args.repeat})")
    print(f"{'MiB':>8}  {'way':<34}{'ms':>9}{'GB/s':>8}{'x zero':>8}{'extra MiB':>11}  ok")
    for n in SIZES:
        mine = [r for r in rows if r["elements"] == n]
        zero_s = next(r["seconds"] for r in mine if r["way"].startswith("zero"))
        for r in mine:
            size = n * 4
            print(f"{size / 2**20:>8.1f}  {r['way']:<34}{r['seconds'] * 1e3:>9.2f}"
                  f"{size / r['seconds'] / 1e9:>8.2f}{r['seconds'] / zero_s:>8.2f}"
                  f"{r['extra_bytes'] / 2**20:>11.1f}  {'yes' if r['ok'] else 'NO'}")
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()

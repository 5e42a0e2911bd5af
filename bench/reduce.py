"""Gradient bucket reduction on gloo (CPU ranks), the choice of issue 22
item 3: a bucket that spans every rank's partition equally, reduced so that
each rank ends with the sum of its own chunk, three ways measured in the
same run: one reduce per destination rank (what the bucket reducer issues,
sharding/_buckets.py), torch's reduce_scatter_tensor, and one all_reduce of
the whole bucket (each rank keeps its chunk). A memcpy of the bucket is the
floor: every byte is read at least once.

Usage: python bench/reduce.py [--world 2] [--repeat 7] [--json out.json]
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

SIZES = [1 << 18, 1 << 22, 1 << 24, 25_000_000]  # elements of a bucket (the last: the default size)
DTYPES = [torch.bfloat16, torch.float32]


def _fastest(call, repeat):
    best = float("inf")
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def _run(rank, world, repeat):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for dtype in DTYPES:
        for n in SIZES:
            chunk = n // world
            source = (torch.arange(n) % 251 + rank).to(dtype)
            # the exact sum, rounded once to the dtype: what every way must
            # give on 2 ranks (on more, the order of the additions may round
            # differently: checked within one rounding step then)
            expected = sum((torch.arange(n) % 251 + r).to(dtype).double()
                           for r in range(world))[rank * chunk:(rank + 1) * chunk]
            expected = expected.to(dtype).float()
            bucket = source.clone()
            out = torch.empty(chunk, dtype=dtype)

            def per_destination():
                bucket.copy_(source)
                works = [dist.reduce(bucket[r * chunk:(r + 1) * chunk], dst=r, async_op=True)
                         for r in range(world)]
                for w in works:
                    w.wait()
                out.copy_(bucket[rank * chunk:(rank + 1) * chunk])

            def reduce_scatter():
                bucket.copy_(source)
                dist.reduce_scatter_tensor(out, bucket)  # what the NCCL path would issue

            def all_reduce():
                bucket.copy_(source)
                dist.all_reduce(bucket)
                out.copy_(bucket[rank * chunk:(rank + 1) * chunk])

            ways = {
                "memcpy of the bucket (floor)": lambda: bucket.copy_(source),
                "zero: a reduce per destination": per_destination,
                "torch reduce_scatter_tensor": reduce_scatter,
                "torch all_reduce, keep own chunk": all_reduce,
            }
            for name, call in ways.items():
                out.zero_()
                seconds = _fastest(call, repeat)
                close = torch.equal(out.float(), expected) if world == 2 else \
                    torch.allclose(out.float(), expected, rtol=2 ** -7 * world, atol=0)
                ok = name.startswith("memcpy") or close
                rows.append({"dtype": str(dtype).replace("torch.", ""), "elements": n,
                             "way": name, "seconds": seconds, "ok": ok})
    dist.destroy_process_group()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = harness.run(args.world, _run, args.repeat, timeout=900)[0]
    print(f"bucket reduction on {args.world} gloo ranks (rank 0; fastest of {args.repeat}; "
          f"each rank keeps the sum of its 1/{args.world} of the bucket)")
    print(f"{'dtype':<9}{'MiB':>8}  {'way':<34}{'ms':>9}{'GB/s':>8}{'x zero':>8}  ok")
    for row in rows:
        mine = [r for r in rows if r["elements"] == row["elements"]
                and r["dtype"] == row["dtype"]]
        zero_s = next(r["seconds"] for r in mine if r["way"].startswith("zero"))
        size = row["elements"] * (2 if row["dtype"] == "bfloat16" else 4)
        print(f"{row['dtype']:<9}{size / 2**20:>8.1f}  {row['way']:<34}"
              f"{row['seconds'] * 1e3:>9.2f}{size / row['seconds'] / 1e9:>8.2f}"
              f"{row['seconds'] / zero_s:>8.2f}  {'yes' if row['ok'] else 'NO'}")
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()

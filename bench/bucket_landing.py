"""How fast one backward's gradients land in their buckets at stages 2-3:
the C hook ([Note: the hook in C] in csrc/module_buckets.c), which copies
each first piece into an unzeroed bucket and zeroes only what no piece
wrote ([Note: no zero-fill] in csrc/buckets.c), against the same plan in
torch calls, and against the machine's copy bandwidth.

Rows (same plan, same gradients, same buckets: a fresh first bucket each
backward, the last one sent reused for the next of its size, as
sharding/_buckets.py does on the CPU):
- zero's C hook: the engine's path, one hook call per gradient;
- torch, zeroed buckets + add_: what the engine did before the no-zero-fill
  change (torch.zeros per bucket, an add_ per piece);
- torch, copy_ into unzeroed buckets: DDP's way of filling a bucket;
- one copy_ a bucket of the same bytes into the same buckets: the data
  movement alone, the limit.

Nothing is reduced: this is the landing alone, on one process.

Usage: python bench/bucket_landing.py [--params 64] [--numel 400000]
       [--bucket 6250000] [--dtype bf16] [--repeats 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from zero._C import GradBuckets  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Buckets:
    """Bucket buffers as the engine makes them on the CPU: unzeroed, the
    last one sent kept for the next of its size within a backward."""

    def __init__(self, sizes, dtype, zeroed):
        self.sizes, self.dtype, self.zeroed = sizes, dtype, zeroed
        self.spare = None

    def new(self, b):
        n = self.sizes[b]
        spare, self.spare = self.spare, None
        if spare is None or spare.numel() != n:
            spare = torch.empty(n, dtype=self.dtype)
        return spare.zero_() if self.zeroed else spare

    def sent(self, tensor):
        self.spare = tensor


class HookOwner:
    """The owner the C hook calls back: buffers, sends (dropped here)."""

    def __init__(self, buckets):
        self.buckets = buckets

    def _new_bucket(self, b, late):
        return self.buckets.new(b)

    def _send_bucket(self, b, tensor):
        self.buckets.sent(tensor)

    def _unit_arrived(self, unit):
        pass

    def _backward_began(self):
        pass

    def _add_piece(self, *args):
        raise RuntimeError("the bench's gradients must take the C path")

    def _zero_range(self, *args):
        raise RuntimeError("the bench's buckets must take the C path")


def pieces_of(core, offsets, numels):
    """Each gradient's (bucket, bucket_start, grad_start, count), from the
    core's bucket ranges (one unit)."""
    ranges = [core.bucket(b)[1:] for b in range(core.count)]
    out = []
    for off, n in zip(offsets, numels):
        mine = []
        for b, (bs, be) in enumerate(ranges):
            lo, hi = max(off, bs), min(off + n, be)
            if lo < hi:
                mine.append((b, lo - bs, lo - off, hi - lo))
        out.append(mine)
    return out


def timed(run, repeats):
    run()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=64)
    ap.add_argument("--numel", type=int, default=400_000)
    ap.add_argument("--bucket", type=int, default=6_250_000)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    n, numel = args.params, args.numel
    offsets = [i * numel for i in range(n)]
    numels = [numel] * n
    torch.manual_seed(0)
    grads = [torch.randn(numel).to(dtype) for _ in range(n)]
    params = [torch.nn.Parameter(torch.zeros(numel, dtype=dtype)) for _ in range(n)]

    buckets = Buckets({}, dtype, zeroed=False)
    owner = HookOwner(buckets)
    core = GradBuckets([0] * n, offsets, numels, [n * numel], args.bucket, owner=owner,
                       dtype=dtype, tensor_type=torch.Tensor, strided=torch.strided)
    buckets.sizes = {b: core.bucket(b)[2] - core.bucket(b)[1] for b in range(core.count)}
    hooks = [core.hook(i) for i in range(n)]
    pieces = pieces_of(core, offsets, numels)

    def zero_hook():
        core.reset(None)
        buckets.spare = None
        for i in reversed(range(n)):  # backward's order
            params[i].grad = grads[i]
            hooks[i](params[i])

    def torch_way(zeroed):
        def run():
            made = Buckets(buckets.sizes, dtype, zeroed)
            filling, left = {}, {b: buckets.sizes[b] for b in buckets.sizes}
            for i in reversed(range(n)):
                flat = grads[i].reshape(-1)
                for b, bs, gs, count in pieces[i]:
                    if b not in filling:
                        filling[b] = made.new(b)
                    target = filling[b][bs:bs + count]
                    piece = flat[gs:gs + count]
                    target.add_(piece) if zeroed else target.copy_(piece)
                    left[b] -= count
                    if left[b] == 0:  # complete: sent
                        made.sent(filling.pop(b))
        return run

    source = torch.cat(grads)
    ranges = [core.bucket(b)[1:] for b in range(core.count)]

    def limit():
        # the same bytes into the same reused buckets, one copy_ a bucket
        # in bucket order: the data movement alone
        made = Buckets(buckets.sizes, dtype, zeroed=False)
        for b, (bs, be) in enumerate(ranges):
            bucket = made.new(b)
            bucket.copy_(source[bs:be])
            made.sent(bucket)

    rows = [("zero's C hook (copy first, gaps zeroed)", zero_hook),
            ("torch: zeroed buckets + add_", torch_way(True)),
            ("torch: copy_ into unzeroed buckets", torch_way(False)),
            ("limit: one copy_ a bucket, same bytes", limit)]
    results = [(name, *timed(run, args.repeats)) for name, run in rows]
    nbytes = n * numel * grads[0].element_size()
    limit_s = results[-1][1]
    print(f"{n} gradients of {numel} {args.dtype} elements ({nbytes / 2**20:.0f} MiB) "
          f"into {core.count} buckets of {args.bucket}; median of {args.repeats}; "
          f"{torch.get_num_threads()} threads")
    print(f"{'path':44} {'median ms':>10} {'min ms':>8} {'GB/s':>7} {'x limit':>8}")
    print("-" * 81)
    for name, median, fastest in results:
        print(f"{name:44} {median * 1e3:10.2f} {fastest * 1e3:8.2f} "
              f"{nbytes / median / 1e9:7.1f} {median / limit_s:8.2f}")


if __name__ == "__main__":
    main()

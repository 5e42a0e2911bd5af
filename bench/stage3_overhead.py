"""Stage 3's cost per step over stage 0, where gathers move little data:
what its per-module hooks (gather, release, prefetch, backward gathers,
saved-tensor hooks, gradient buckets) cost in Python and torch calls. A
small GPT keeps the matrix work small beside the hooks; stages run in
turns, step by step, so the machine's drift falls on both.

With --released, stage3_param_persistence_threshold is 0: every unit is
gathered before use and released after, so the overhead includes the
gathers (a copy at world size 1); by default units under DeepSpeed's
threshold (1e5 elements: here every block) stay gathered.

With --world N (N > 1) every rank runs the same loop on gloo and rank 0
prints; the table then has a third engine, "stage 3 apart", whose small
units are each gathered by a collective of their own instead of together
([Note: small units gathered together] in comm/_gather_together.py).
With --world N there is also "stage 3 own buckets", whose units are each
reduced in buckets of their own instead of small ones sharing a bucket
([Note: small units share a bucket] in csrc/zero.h), and "stage 2".
With --reuse D a "stage 3 reuse" engine keeps units whose next use comes
within D elements ([Note: reuse distance] in sharding/_pass_order.py).

Usage: python bench/stage3_overhead.py [--steps 30] [--rounds 3] [--layers 8]
       [--dim 64] [--released] [--world 1] [--reuse 1e9]
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
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))

import zero  # noqa: E402
from gpt import GPT, GPTConfig, MarkovText  # noqa: E402


def make_stepper(stage, cfg, data, released=False, rank=0, apart=False, reuse=0,
                 own_buckets=False):
    torch.manual_seed(0)
    model = GPT(cfg)
    options = {"stage3_param_persistence_threshold": 0} if released and stage == 3 else {}
    if reuse:
        options["stage3_max_reuse_distance"] = reuse
    if own_buckets:  # the bucket plan without unit parts: no bucket shared
        from zero.sharding import _buckets  # (imported here: older trees lack it)
        real = _buckets._GradBuckets
        _buckets._GradBuckets = lambda *a, unit_parts=None, chunks=1, **kw: real(*a, **kw)
    try:
        engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
                                 stage=stage, precision="bf16", gradient_clipping=1.0,
                                 **options)
    finally:
        if own_buckets:
            _buckets._GradBuckets = real
    if apart:  # [Note: small units gathered together] off: a collective per unit
        for fg in engine.all_groups:
            fg.gathers_together = False

    def step(i):
        ids, labels = data.batch(4, i, rank)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
    return engine, step


def measure(rank, world, args):
    """Median step times in ms per engine, and what rank 0 prints."""
    if world > 1:
        torch.set_num_threads(1)
    cfg = GPTConfig(vocab=256, dim=args.dim, layers=args.layers, heads=4, seq=32)
    data = MarkovText(cfg.vocab, cfg.seq)
    runners = {"stage 0": make_stepper(0, cfg, data, rank=rank),
               "stage 3": make_stepper(3, cfg, data, args.released, rank)}
    if world > 1:
        runners["stage 3 apart"] = make_stepper(3, cfg, data, args.released, rank, apart=True)
        runners["stage 3 own buckets"] = make_stepper(3, cfg, data, args.released, rank,
                                                      own_buckets=True)
        runners["stage 2"] = make_stepper(2, cfg, data, rank=rank)
    if args.reuse:
        runners["stage 3 reuse"] = make_stepper(3, cfg, data, args.released, rank,
                                                reuse=int(args.reuse))
    for _engine, step in runners.values():
        for i in range(3):  # warm-up: stage 3 records its order on the first pass
            step(i)
    samples = {name: [] for name in runners}
    for _ in range(args.rounds):
        for i in range(args.steps):
            for name, (_engine, step) in runners.items():
                start = time.perf_counter()
                step(i)
                samples[name].append(time.perf_counter() - start)
    engine3 = runners["stage 3"][0]
    hooked = len(engine3._schedule.modules)
    released = sum(not u.persistent for fg in engine3.all_groups for u in fg.units)
    # the last step's collectives (comm_summary counts since the last step)
    ops = {name: engine.comm_summary()["ops"] for name, (engine, _step) in runners.items()}
    gathers = {name: (o.get("all_gather", {}).get("calls", 0),
                      sum(o.get(op, {}).get("calls", 0)
                          for op in ("reduce", "reduce_scatter", "all_reduce")))
               for name, o in ops.items()}
    for engine, _step in runners.values():
        engine.close()
    ms = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    return ms, (cfg, hooked, released, gathers)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64, help="the GPT's width")
    ap.add_argument("--released", action="store_true",
                    help="persistence threshold 0: every unit released after use")
    ap.add_argument("--world", type=int, default=1, help="gloo ranks")
    ap.add_argument("--reuse", type=float, default=0,
                    help="add a stage 3 engine with this stage3_max_reuse_distance "
                         "(DeepSpeed's default is 1e9)")
    args = ap.parse_args()
    if args.world > 1:
        import harness
        ms, (cfg, hooked, released, gathers) = harness.run(args.world, measure, args,
                                                           timeout=1800)[0]
    else:
        ms, (cfg, hooked, released, gathers) = measure(0, 1, args)
    print(f"GPT: {args.layers} blocks, width {cfg.dim}, batch 4 x {cfg.seq} a rank, bf16, "
          f"{args.world} rank(s); {hooked} modules hooked at stage 3, {released} units "
          f"released after use; median of {args.rounds} x {args.steps} steps\n")
    print(f"{'engine':<20} {'step ms':>8} {'over stage 0 ms':>15} {'per module us':>13} "
          f"{'gathers a step':>14} {'reductions a step':>17}")
    for name, t in ms.items():
        over = t - ms["stage 0"]
        print(f"{name:<20} {t:>8.2f} {over:>15.2f} {over / hooked * 1e3:>13.1f} "
              f"{gathers[name][0]:>14} {gathers[name][1]:>17}")


if __name__ == "__main__":
    main()

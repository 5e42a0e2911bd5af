"""Stage 3's cost per step over stage 0 in one process, where no gather
moves data: what its per-module hooks (gather, release, prefetch, backward
gathers, saved-tensor hooks, gradient buckets) cost in Python and torch
calls. A small GPT keeps the matrix work small beside the hooks; stages run
in turns, step by step, so the machine's drift falls on both.

With --released, stage3_param_persistence_threshold is 0: every unit is
gathered before use and released after, so the overhead includes the
gathers (a copy at world size 1); by default units under DeepSpeed's
threshold (1e5 elements: here every block) stay gathered.

Usage: python bench/stage3_overhead.py [--steps 30] [--rounds 3] [--layers 8] [--released]
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

import zero  # noqa: E402
from gpt import GPT, GPTConfig, MarkovText  # noqa: E402


def make_stepper(stage, cfg, data, released=False):
    torch.manual_seed(0)
    model = GPT(cfg)
    options = {"stage3_param_persistence_threshold": 0} if released and stage == 3 else {}
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
                             stage=stage, precision="bf16", gradient_clipping=1.0, **options)

    def step(i):
        ids, labels = data.batch(4, i)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
    return engine, step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--released", action="store_true",
                    help="persistence threshold 0: every unit released after use")
    args = ap.parse_args()
    cfg = GPTConfig(vocab=256, dim=64, layers=args.layers, heads=4, seq=32)
    data = MarkovText(cfg.vocab, cfg.seq)
    runners = {stage: make_stepper(stage, cfg, data, args.released) for stage in (0, 3)}
    for _engine, step in runners.values():
        for i in range(3):  # warm-up: stage 3 records its order on the first pass
            step(i)
    samples = {stage: [] for stage in runners}
    for _ in range(args.rounds):
        for i in range(args.steps):
            for stage, (_engine, step) in runners.items():
                start = time.perf_counter()
                step(i)
                samples[stage].append(time.perf_counter() - start)
    hooked = len(runners[3][0]._schedule.modules)
    released = sum(not u.persistent for fg in runners[3][0].all_groups for u in fg.units)
    ms = {stage: statistics.median(s) * 1e3 for stage, s in samples.items()}
    print(f"GPT: {args.layers} blocks, width {cfg.dim}, batch 4 x {cfg.seq}, bf16; "
          f"{hooked} modules hooked at stage 3, {released} units released after use; "
          f"median of {args.rounds} x {args.steps} steps\n")
    print(f"{'stage 0 ms':>10} {'stage 3 ms':>10} {'overhead ms':>11} {'per module us':>13}")
    print(f"{ms[0]:>10.2f} {ms[3]:>10.2f} {ms[3] - ms[0]:>11.2f} "
          f"{(ms[3] - ms[0]) / hooked * 1e3:>13.1f}")
    for engine, _step in runners.values():
        engine.close()


if __name__ == "__main__":
    main()

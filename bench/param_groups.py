"""Many param groups on gloo ranks: layer-wise learning rates (two groups a
layer, as layer-wise decay recipes build them) against the usual two groups
(weight decay or not), zero's stages 0-3 against torch DDP on the same
model, data and AdamW groups. Each param group is its own flat buffer in
zero, so a group's collectives (a boundary reduction, a bucket, the flag
agreement, the refresh of the parameters) were paid per group; they go
together now ([Note: small groups reduced together] in
python/zero/comm/_reduce_together.py). The table gives the step time, its
ratio to DDP's with the same groups, and zero's collectives a step as
comm_summary counts them (a gather is one, whatever the broadcasts under
it).

Usage: python bench/param_groups.py [--world 2] [--layers 12] [--dim 256]
       [--steps 10] [--rounds 3] [--runners ddp,zero0,zero1,zero2,zero3]
       [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))

import harness  # noqa: E402  the tests' launcher of real gloo processes

from _results import write_json

OPS = ("reduce", "all_reduce", "all_gather")


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def make_model(layers, dim):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, dim), *[Block(dim) for _ in range(layers)],
                         nn.Linear(dim, 8))


def param_groups(model, layerwise):
    """Two groups (matrices with weight decay, the rest without), or two a
    top-level module with the learning rate decaying toward the input."""
    if not layerwise:
        named = list(model.named_parameters())
        return [{"params": [p for _n, p in named if p.ndim == 2], "weight_decay": 0.01},
                {"params": [p for _n, p in named if p.ndim != 2], "weight_decay": 0.0}]
    groups = []
    for depth, module in enumerate(model):
        params = list(module.parameters())
        lr = 1e-3 * 0.9 ** (len(model) - depth)
        groups.append({"params": [p for p in params if p.ndim == 2], "lr": lr,
                       "weight_decay": 0.01})
        groups.append({"params": [p for p in params if p.ndim != 2], "lr": lr,
                       "weight_decay": 0.0})
    return groups


def _run(rank, world, runner, layerwise, layers, dim, steps, rounds):
    import torch.distributed as dist
    import zero
    torch.set_num_threads(1)
    model = make_model(layers, dim)
    groups = param_groups(model, layerwise)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 32, 64, generator=g), torch.randn(16, 32, 8, generator=g)
    if runner == "ddp":
        dist.init_process_group("gloo")
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(groups, lr=1e-3)

        def step():
            (ddp(x) - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        engine = None
    else:
        engine = zero.initialize(model, optimizer=torch.optim.AdamW(groups, lr=1e-3),
                                 stage=int(runner[-1]))

        def step():
            engine.backward((engine(x) - y).pow(2).mean())
            engine.step()
    for _ in range(2):  # warm up: the first steps record and allocate
        step()
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        times.append((time.perf_counter() - start) / steps)
    calls = {}
    if engine is not None:
        ops = engine.comm_summary()["ops"]  # the last step's
        calls = {op: ops[op]["calls"] for op in OPS if op in ops}
        engine.close()
    else:
        dist.destroy_process_group()
    return sorted(times)[len(times) // 2], len(groups), calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runners", default="ddp,zero0,zero1,zero2,zero3")
    parser.add_argument("--json")
    args = parser.parse_args()
    runners = args.runners.split(",")
    unknown = [r for r in runners if r not in ("ddp", "zero0", "zero1", "zero2", "zero3")]
    if unknown:
        parser.error(f"--runners: unknown {unknown}; choose from ddp, zero0-zero3")
    rows = []
    for layerwise in (False, True):
        for runner in runners:
            seconds, groups, calls = harness.run(
                args.world, _run, runner, layerwise, args.layers, args.dim, args.steps,
                args.rounds, timeout=1800)[0]
            rows.append(dict(runner=runner, layerwise=layerwise, groups=groups,
                             step_ms=seconds * 1e3, calls=calls))
    ddp = {r["layerwise"]: r["step_ms"] for r in rows if r["runner"] == "ddp"}
    print(f"{args.world} gloo ranks, {args.layers} blocks of width {args.dim}, AdamW, "
          f"median of {args.rounds} rounds of {args.steps} steps")
    print(f"{'runner':8s} {'groups':>6s} {'ms/step':>8s} {'/DDP':>6s}   "
          + "  ".join(f"{op:>10s}" for op in OPS))
    for r in rows:
        ratio = r["step_ms"] / ddp[r["layerwise"]] if r["layerwise"] in ddp else float("nan")
        print(f"{r['runner']:8s} {r['groups']:6d} {r['step_ms']:8.1f} {ratio:6.2f}   "
              + "  ".join(f"{r['calls'].get(op, '-')!s:>10s}" for op in OPS))
    if args.json:
        write_json(args.json, dict(args=vars(args), rows=rows))


if __name__ == "__main__":
    main()

"""Data, tensor and pipeline parallelism on 4 CPU ranks (gloo): the step
time of one GPT trained by zero at stage 1 on dp=4, tp=2 x dp=2, pp=2 x dp=2
and pp=2 x tp=2, and what each rank sends per step, measured beside the
formulas:

- data parallel (zero's collectives, engine.comm_summary()): ZeRO's 2Ψ per
  rank for stages 1-2 (a reduce-scatter and an all-gather of the rank's
  Ψ parameters; an all-reduce of n counts 2n), and with pp the tied head's
  gradient summed over the stage's data-parallel ranks (an all-reduce of
  V x h / tp);
- tensor parallel (DTensor's collectives, counted here by a dispatch mode
  over one step): Megatron-LM's per layer and micro-batch of T tokens of
  width h: two all-reduces of T x h in forward and two in backward (2Th
  moved each), plus the vocabulary-parallel embedding's all-reduce (2Th),
  the head's all-gather of the logits (TV) and its input gradient's
  all-reduce (2Th); with the vocabulary-parallel loss (tp2xdp2-lp:
  parallelize_gpt(loss_parallel=True) and torch's loss_parallel()), no
  logits gathered, but three all-reduces of one number a token (the
  maximum, the sum of exponentials, the target's logit: 6T); with
  Megatron's sequence parallelism (tp2xdp2-sp: parallelize_gpt(
  sequence_parallel=True)) each all-reduce becomes a reduce-scatter and
  an all-gather of the same T x h (Th each: the same 2Th), the head's
  input is all-gathered (Th) and its gradient reduce-scattered (Th), and
  the norms' weight gradients are all-reduced (two norms of 2h a layer
  and the final one: 2 x (4h x layers + 2h)), and the position
  embedding's gradient is all-gathered from sequence shards (T_seq x h);
- pipeline (torch's point-to-point sends, counted by wrapping them): each
  micro-batch's activations forward and their gradients backward, T x h
  per stage boundary; with two stages a rank (pp2xdp2-v2: split_gpt(
  stages_per_rank=2), torch's interleaved 1F1B) a rank sends forward from
  each stage but the last and backward from each but the first.

What two cores can show: the 4 processes share 2 cores, so step times
measure overheads and the work each layout adds, not the speed-up that
more devices would give.

Usage: python bench/parallel.py [--steps 5] [--warmup 2] [--json out.json]
       [--layouts dp4,tp2xdp2,tp2xdp2-lp,tp2xdp2-sp,pp2xdp2,pp2xdp2-v2,pp2xtp2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))

from gpt import GPT, GPTConfig, MarkovText  # noqa: E402

from _results import write_json  # noqa: E402

WORLD = 4
CFG = GPTConfig(vocab=2048, dim=256, layers=4, heads=8, seq=64)
GLOBAL_BATCH = 16  # sequences per step, split over the data-parallel ranks
MICRO_BATCHES = 4
LAYOUTS = {"dp4": ((4,), ("dp_shard",)), "tp2xdp2": ((2, 2), ("dp_shard", "tp")),
           "tp2xdp2-lp": ((2, 2), ("dp_shard", "tp")),
           "tp2xdp2-sp": ((2, 2), ("dp_shard", "tp")),
           "pp2xdp2": ((2, 2), ("pp", "dp_shard")), "pp2xdp2-v2": ((2, 2), ("pp", "dp_shard")),
           "pp2xtp2": ((2, 2), ("pp", "tp"))}
COLLECTIVE_WEIGHT = {"all_reduce": 2}  # ZeRO's accounting: an all-reduce of n moves 2n
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single")


class CollectiveElements:
    """Counts the elements DTensor's functional collectives move (as zero's
    comm_summary counts them), while entered."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        counts = self.counts = defaultdict(int)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from torch.distributed.tensor import DTensor
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented  # let DTensor turn it into collectives first
                out = func(*args, **(kwargs or {}))
                name = func._overloadpacket.__name__
                if func.namespace in ("_c10d_functional", "c10d_functional") and \
                        name in COLLECTIVES:
                    moved = out if name.startswith("all_gather") else args[0]
                    if torch.is_tensor(moved):
                        counts[name] += COLLECTIVE_WEIGHT.get(name, 1) * moved.numel()
                return out
        self.mode = Mode()


def count_sends(counts):
    """Wrap the pipeline schedules' point-to-point batches so `counts` gets
    the elements each rank sends (activations and their gradients). A
    private function of torch's, wrapped for counting only: every send of
    the schedules goes through it."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules
    original = schedules._batch_p2p

    def batch_p2p(ops, *args, **kwargs):
        counts["p2p send"] += sum(op.tensor.numel() for op in ops if op.op is dist.isend)
        return original(ops, *args, **kwargs)
    schedules._batch_p2p = batch_p2p


def worker(rank, world, layout, warmup, steps):
    import torch.distributed as dist
    import zero
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo")
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = GPT(CFG)
    per_rank = 2 if layout.endswith("-v2") else 1
    if "pp" in names:
        model = zero.parallel.split_gpt(model, mesh["pp"], stages_per_rank=per_rank)
    loss_parallel = layout.endswith("-lp")
    if "tp" in names:
        zero.parallel.parallelize_gpt(model, mesh["tp"], loss_parallel=loss_parallel,
                                      sequence_parallel=layout.endswith("-sp"))
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                             stage=1, mesh=mesh)
    dp = mesh["dp_shard"] if "dp_shard" in names else None
    dp_rank, dp_size = (dp.get_local_rank(), dp.size()) if dp is not None else (0, 1)
    batch = GLOBAL_BATCH // dp_size
    data = MarkovText(CFG.vocab, CFG.seq)
    counts = defaultdict(int)
    if "pp" in names:
        count_sends(counts)
        pipe = zero.parallel.pipeline_schedule(engine, mesh["pp"], MICRO_BATCHES,
                                               zero.parallel.gpt_loss)  # 1F1B, interleaved
        stage, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()

        def step(ids, labels):
            if stage == 0:
                pipe.step(ids)
            elif stage == stages - 1:
                pipe.step(target=labels)
            else:
                pipe.step()
            engine.step()
    elif loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as vocabulary_parallel

        def step(ids, labels):
            with vocabulary_parallel():
                engine.backward(engine(ids, labels))
            engine.step()
    else:
        def step(ids, labels):
            engine.backward(engine(ids, labels))
            engine.step()
    counter = CollectiveElements()
    times = []
    for i in range(warmup + steps):
        ids, labels = data.batch(batch, i, dp_rank)
        last = i == warmup + steps - 1
        if last:
            counts.clear()
        dist.barrier()
        start = time.perf_counter()
        if last:
            with counter.mode:
                step(ids, labels)
        else:
            step(ids, labels)
        times.append(time.perf_counter() - start)
    psi = sum(p.numel() for p in model.parameters())
    out = dict(median_s=statistics.median(times[warmup:]), psi=psi,
               dp_moved=engine.comm_summary()["moved_elements"],
               tp_moved=sum(counter.counts.values()), tp_ops=dict(counter.counts),
               p2p_sent=counts["p2p send"], dp_size=dp_size, batch=batch,
               pp_rank=mesh["pp"].get_local_rank() if "pp" in names else 0)
    engine.close()
    dist.destroy_process_group()
    return out


def formulas(layout, row):
    """(ZeRO's dp elements, Megatron's tp elements, the pipeline's sends)
    per rank per step."""
    shape, names = LAYOUTS[layout]
    sizes = dict(zip(names, shape))
    tp, pp = sizes.get("tp", 1), sizes.get("pp", 1)
    tokens = row["batch"] * CFG.seq  # the rank's tokens per step
    h, v = CFG.dim, CFG.vocab
    dp = 2 * row["psi"]
    if pp > 1:  # the tied head's gradient summed over the stage's data-parallel ranks
        dp += 2 * v * h // tp
    layers = CFG.layers // pp
    megatron = 0
    if tp > 1:
        megatron = layers * 4 * 2 * tokens * h  # 2 all-reduces forward, 2 backward, a layer
        # the embedding's all-reduce on the first stage; the head's logits
        # all-gather (or the vocabulary-parallel loss's three all-reduces of
        # one number a token) and input-gradient all-reduce on the last
        head = 6 * tokens if layout.endswith("-lp") else tokens * v
        megatron += 2 * tokens * h + head + 2 * tokens * h if pp == 1 else \
            max(2 * tokens * h, head + 2 * tokens * h)
    if layout.endswith("-sp"):  # all-reduces split in two; the norms' and positions' gradients
        megatron += 2 * (4 * h * layers + 2 * h) + CFG.seq * h
    p2p = 0
    if pp > 1:  # forward from each stage but the last, backward from each but the first
        per_rank = 2 if layout.endswith("-v2") else 1
        held = [row["pp_rank"] + k * pp for k in range(per_rank)]
        count = pp * per_rank
        p2p = tokens * h * sum((i < count - 1) + (i > 0) for i in held)
    return dp, megatron, p2p


def main(argv=None):
    import harness
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = {}
    for layout in args.layouts.split(","):
        results = harness.run(WORLD, worker, layout, args.warmup, args.steps)
        rows[layout] = dict(results=results, median_s=max(r["median_s"] for r in results))
        print(f"  ran {layout}: {rows[layout]['median_s']:.3f} s", flush=True)
    n = sum(p.numel() for p in GPT(CFG).parameters())
    print(f"\nGPT of {n / 1e6:.2f}M parameters ({CFG.layers} layers, width {CFG.dim}, "
          f"vocabulary {CFG.vocab}, {CFG.seq} tokens), {WORLD} ranks (gloo) on this machine's "
          f"cores, fp32, zero stage 1, {GLOBAL_BATCH} sequences a step "
          f"(pp: {MICRO_BATCHES} micro-batches, 1F1B; -v2: two stages a rank, interleaved "
          f"1F1B); median of {args.steps} steps.")
    print("Elements each rank moves in a step (max over ranks), measured / formula.")
    header = f"{'layout':<10} {'step s':>7} {'dp (zero)':>20} {'tp (DTensor)':>22} " \
             f"{'pp sends':>20}"
    print(header + "\n" + "-" * len(header))
    for layout, row in rows.items():
        measured = {key: max(r[key] for r in row["results"])
                    for key in ("dp_moved", "tp_moved", "p2p_sent")}
        expected = [max(f) for f in zip(*(formulas(layout, r) for r in row["results"]))]
        cells = [f"{measured[k]:>10,} / {e:<9,}" for k, e in
                 zip(("dp_moved", "tp_moved", "p2p_sent"), expected)]
        if row["results"][0]["dp_size"] == 1:  # no peers: zero logs what it would send
            cells[0] = "no dp peers"
        print(f"{layout:<10} {row['median_s']:>7.3f} {cells[0]:>20} {cells[1]:>22} "
              f"{cells[2]:>20}")
    tp_ops = {layout: row["results"][0]["tp_ops"] for layout, row in rows.items()}
    print("\ntp collectives (elements moved, rank 0):", tp_ops)
    if args.json:
        write_json(args.json, {k: {kk: vv for kk, vv in v.items()} for k, v in rows.items()})


if __name__ == "__main__":
    main()

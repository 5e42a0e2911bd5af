"""The main job: train a small GPT with zero on this machine.

    torchrun --nproc_per_node 2 examples/train_gpt.py            # 2 ranks
    python examples/train_gpt.py                                 # 1 process
    torchrun --nproc_per_node 2 examples/train_gpt.py --stage 3 --partitioned-init
    torchrun --nproc_per_node 8 examples/train_gpt.py --device cuda  # a GPU per rank
    torchrun --nproc_per_node 8 examples/train_gpt.py --tp 2 --pp 2   # 3D: pp x dp x tp
    torchrun --nproc_per_node 4 examples/train_gpt.py --tp 2 --pp 2 --sequence-parallel \
        --stages-per-rank 2   # Megatron's sequence parallelism, interleaved 1F1B

Each rank trains on its own batches of a synthetic Markov language; the
script prints the loss as it falls and, at the end, each rank's memory
beside the ZeRO formula for the stage.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero  # noqa: E402
from gpt import GPT, GPTConfig, MarkovText  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                    help="auto: bf16 on a GPU or a CPU with bf16 instructions, else fp32")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--partitioned-init", action="store_true",
                    help="build the model with zero.partitioned_init (each rank holds 1/N)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: rank r trains on GPU LOCAL_RANK")
    ap.add_argument("--offload-nvme", metavar="DIR",
                    help="keep the AdamW states (and, in bf16/fp16, the fp32 master) in "
                         "files under DIR, an existing directory (offload_optimizer device nvme), and at stage 3 "
                         "the parameter shard too (offload_param)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallelism: heads, MLP and vocabulary split over TP ranks")
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline parallelism: blocks cut into PP stages (1F1B schedule)")
    ap.add_argument("--micro-batches", type=int, default=4,
                    help="with --pp: micro-batches each batch is streamed in")
    ap.add_argument("--stages-per-rank", type=int, default=1,
                    help="with --pp: stages each rank holds (more than 1: interleaved 1F1B)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="with --tp: the residual stream and norms split by sequence too")
    args = ap.parse_args()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)

    precision, why = choose_precision(args.precision, device)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    cfg = GPTConfig()
    if args.partitioned_init:
        with zero.partitioned_init():
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())  # before stage 3 releases them
    mesh, model = model_parallel(args, model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # built in host memory; the engine moves it (a partitioned model one
    # parameter at a time)
    offload = {"device": "nvme", "nvme_path": args.offload_nvme} if args.offload_nvme else {}
    engine = zero.initialize(model, optimizer=optimizer, stage=args.stage,
                             precision=precision, gradient_clipping=1.0, device=device,
                             offload_optimizer=offload,
                             offload_param=offload if args.stage == 3 else {}, mesh=mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank = mesh["dp_shard"].get_local_rank() if mesh is not None else rank
    data = MarkovText(cfg.vocab, cfg.seq)
    if rank == 0:
        layout = f"pp {args.pp} x dp {world // (args.tp * args.pp)} x tp {args.tp}" \
            if mesh is not None else f"{world} rank(s)"
        print(f"zero {zero.__version__}: GPT of {n / 1e6:.1f}M parameters, stage {args.stage}, "
              f"{precision}{why}, {layout}, step on {engine.step_path.name}", flush=True)
    step_batch = pipelined(engine, mesh, args) if args.pp > 1 else \
        lambda ids, labels: engine(ids, labels)
    start = time.perf_counter()
    for step in range(args.steps):
        ids, labels = (t.to(device) for t in data.batch(args.batch, step, dp_rank))
        loss = step_batch(ids, labels)
        if args.pp == 1:
            engine.backward(loss)
        engine.step()
        if step % 10 == 0 or step == args.steps - 1:
            # the mean over the ranks that computed the loss (pp: the last stage's)
            t = torch.tensor([loss.item(), 1.0] if loss is not None else [0.0, 0.0],
                             device=device)
            dist.all_reduce(t)
            if rank == 0:
                print(f"step {step:4d}  loss {t[0].item() / t[1].item():.4f}  "
                      f"grad norm {engine.get_global_grad_norm():.3f}  "
                      f"{time.perf_counter() - start:.1f}s", flush=True)
    summary = engine.memory_summary()
    for r in range(world):
        if r == rank:
            print(f"\nrank {rank} memory (model states vs the ZeRO formula):\n{summary}",
                  flush=True)
        dist.barrier()
    engine.close()


def model_parallel(args, model, device):
    """(mesh, this rank's model) for --tp and --pp: a mesh (pp, dp_shard,
    tp) over the world, the model cut into pipeline stages by blocks and
    each stage split over tp by zero.parallel's plans; (None, model)
    without them."""
    if args.tp == 1 and args.pp == 1:
        return None, model
    from torch.distributed.device_mesh import init_device_mesh
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    if args.partitioned_init or world % (args.tp * args.pp):
        raise SystemExit(f"--tp {args.tp} x --pp {args.pp} must divide the {world} ranks, "
                         "without --partitioned-init")
    mesh = init_device_mesh(device.type, (args.pp, world // (args.tp * args.pp), args.tp),
                            mesh_dim_names=("pp", "dp_shard", "tp"))
    if args.pp > 1:
        model = zero.parallel.split_gpt(model, mesh["pp"], stages_per_rank=args.stages_per_rank)
    if args.tp > 1:
        zero.parallel.parallelize_gpt(model, mesh["tp"],
                                      sequence_parallel=args.sequence_parallel)
    return mesh, model


def pipelined(engine, mesh, args):
    """One batch through the pipeline (1F1B, or interleaved 1F1B with
    several stages a rank): its mean loss on the last stage, None on the
    others."""
    schedule = zero.parallel.pipeline_schedule(engine, mesh["pp"], args.micro_batches,
                                               zero.parallel.gpt_loss)
    stage, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()

    def step_batch(ids, labels):
        losses = []
        if stage == 0:
            schedule.step(ids)
        elif stage == stages - 1:
            schedule.step(target=labels, losses=losses)
            return sum(losses)
        else:
            schedule.step()
        return None
    return step_batch


def choose_precision(requested, device):
    """The precision to train in, and why when it was chosen here. torch
    computes bf16 on a CPU without bf16 instructions (AVX2 only) through
    conversions: its matmuls then run 20-50x slower than fp32 (measured on
    an AVX2 EPYC: 0.51 s against 0.011 s for 1024x256 @ 256x1024), which
    would turn this minute-long job into a quarter of an hour. All ranks
    of one machine choose alike (initialize would refuse otherwise)."""
    if requested != "auto":
        return requested, ""
    if device.type == "cuda":
        return "bf16", ""
    features = zero._C.cpu_info()["features"].split()
    if "avx512_bf16" in features:  # AMX CPUs have it too
        return "bf16", ""
    return "fp32", " (auto: this CPU has no bf16 instructions)"


if __name__ == "__main__":
    main()

"""Checkpoint save and load time of the ~30M-parameter GPT of bench/train.py
on 2 CPU ranks (gloo, bf16, AdamW after one training step): zero stages 2
and 3 beside FSDP2 with torch.distributed.checkpoint and DeepSpeed, and
beside the disk itself, measured in the same run.

The disk row: each rank writes, fsyncs and reads back as many bytes as its
largest file in zero's checkpoint, with plain file calls; that is the
limit a checkpoint's own I/O can reach here. zero and torch DCP fsync what
they write (a checkpoint that `latest` names survives a power cut);
DeepSpeed's torch.save does not, which flatters its save time. Loads read
files just written, so they come from the page cache on every row.

Each runner builds the model in fresh processes, trains one step, then
saves and loads --repeat times; the table gives the fastest of each.

Usage: python bench/checkpoint.py [--runners zero2,zero3,fsdp2r,ds2,ds3]
       [--repeat 3] [--dir /tmp/zero-ckpt-bench] [--small] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))

import train as train_bench  # noqa: E402  the same model, data and peer set-ups
from gpt import MarkovText  # noqa: E402

from _results import write_json

WORLD = 2


def zero_io(stage, small):
    import zero
    model, cfg = train_bench.build(small)
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                             stage=stage, precision="bf16",
                             **(train_bench.STAGE3 if stage == 3 else {}))

    def step(ids, labels):
        engine.backward(engine(ids, labels))
        engine.step()
    return step, cfg, engine.save_checkpoint, engine.load_checkpoint


def fsdp2_io(small):
    """FSDP2 (reshard_after_forward=True) with torch.distributed.checkpoint,
    the way torch's docs save and resume model and optimizer together."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, cfg = train_bench.build(small)
    train_bench.fsdp2_shard(model, "bf16", True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids, labels):
        model(ids, labels).backward()
        opt.step()
        opt.zero_grad()

    def save(directory):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)

    def load(directory):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return step, cfg, save, load


def deepspeed_io(stage, small):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    model, cfg = train_bench.build(small)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=train_bench.deepspeed_config(stage, "bf16"),
                                      dist_init_required=False)

    def step(ids, labels):
        engine.backward(engine(ids, labels))
        engine.step()
    return step, cfg, engine.save_checkpoint, engine.load_checkpoint


RUNNERS = {
    "zero2": ("zero stage 2", lambda s: zero_io(2, s)),
    "zero3": ("zero stage 3", lambda s: zero_io(3, s)),
    "fsdp2r": ("FSDP2 + torch DCP", fsdp2_io),
    "ds2": ("DeepSpeed stage 2", lambda s: deepspeed_io(2, s)),
    "ds3": ("DeepSpeed stage 3", lambda s: deepspeed_io(3, s)),
}


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _tree_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def _largest_file(path):
    return max(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def io_worker(rank, world, key, small, repeat, directory):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    step, cfg, save, load = RUNNERS[key][1](small)
    data = MarkovText(cfg.vocab, cfg.seq)
    step(*data.batch(train_bench.BATCH, 0, rank))  # optimizer states exist from here
    target = os.path.join(directory, key)
    saves, loads = [], []
    for _ in range(repeat):
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
        dist.barrier()
        saves.append(_timed(lambda: save(target)))
        loads.append(_timed(lambda: load(target)))
    written = _tree_bytes(target)
    largest = _largest_file(target)
    disk = disk_limit(rank, directory, largest, repeat) if key == "zero3" else None
    dist.barrier()
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
    return dict(save_s=min(saves), load_s=min(loads), bytes=written, disk=disk,
                params=sum(p.numel() for p in train_bench.build(small)[0].parameters()))


def disk_limit(rank, directory, nbytes, repeat):
    """Seconds for every rank to write+fsync, then read back, nbytes of its
    own with plain file calls (the fastest of `repeat`)."""
    payload = os.urandom(1 << 20) * max(1, nbytes >> 20)
    path = os.path.join(directory, f"disk-{rank}.bin")
    writes, reads = [], []
    for _ in range(repeat):
        def write():
            with open(path, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())

        def read():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass
        writes.append(_timed(write))
        reads.append(_timed(read))
    os.remove(path)
    return dict(write_s=min(writes), read_s=min(reads), bytes=len(payload) * WORLD)


def main(argv=None):
    import harness
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runners", default=",".join(RUNNERS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/zero-ckpt-bench")
    ap.add_argument("--small", action="store_true", help="a tiny model, for a smoke run")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    keys = args.runners.split(",")
    unknown = [k for k in keys if k not in RUNNERS]
    if unknown:
        ap.error(f"unknown runner(s) {', '.join(unknown)}; choose from {', '.join(RUNNERS)}")
    if "zero3" not in keys:
        keys.insert(0, "zero3")  # it also measures the disk
    os.makedirs(args.dir, exist_ok=True)
    rows = {}
    for key in keys:
        try:
            results = harness.run(WORLD, io_worker, key, args.small, args.repeat, args.dir)
            rows[key] = {**results[0], "name": RUNNERS[key][0], "ok": True,
                         "save_s": max(r["save_s"] for r in results),
                         "load_s": max(r["load_s"] for r in results)}
            if key == "zero3":
                disk = results[0]["disk"]
                disk["write_s"] = max(r["disk"]["write_s"] for r in results)
                disk["read_s"] = max(r["disk"]["read_s"] for r in results)
        except Exception as exc:  # print why a peer cannot run here
            reason = str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else repr(exc)
            rows[key] = dict(name=RUNNERS[key][0], ok=False, reason=reason)
        print(f"  ran {RUNNERS[key][0]}: " + ("ok" if rows[key]["ok"] else rows[key]["reason"]),
              flush=True)
    print_table(rows, args)
    if args.json:
        write_json(args.json, rows)


def print_table(rows, args):
    ours = rows.get("zero3", {})
    params = ours.get("params", 0)
    print(f"\nGPT of {params / 1e6:.1f}M parameters, {WORLD} ranks (gloo), bf16, AdamW; "
          f"fastest of {args.repeat}; checkpoint in {args.dir}")
    print(f"{'':<24}{'MiB':>8}{'save s':>9}{'MiB/s':>8}{'load s':>9}{'MiB/s':>8}"
          f"{'save/zero3':>11}{'load/zero3':>11}")
    if ours.get("ok") and ours.get("disk"):
        d = ours["disk"]
        mib = d["bytes"] / 2**20
        print(f"{'disk (write+fsync/read)':<24}{mib:>8.0f}{d['write_s']:>9.3f}"
              f"{mib / d['write_s']:>8.0f}{d['read_s']:>9.3f}{mib / d['read_s']:>8.0f}")
    for key, row in rows.items():
        if not row["ok"]:
            print(f"{row['name']:<24}  could not run: {row['reason']}")
            continue
        mib = row["bytes"] / 2**20
        rel = lambda k: f"{row[k] / ours[k]:>11.2f}" if ours.get("ok") else f"{'-':>11}"  # noqa
        print(f"{row['name']:<24}{mib:>8.0f}{row['save_s']:>9.3f}{mib / row['save_s']:>8.0f}"
              f"{row['load_s']:>9.3f}{mib / row['load_s']:>8.0f}{rel('save_s')}{rel('load_s')}")


if __name__ == "__main__":
    main()

"""A model larger than this machine's memory, trained here: a GPT built under
zero.partitioned_init with its chunks on the disk, trained at stage 3 with
the parameter shard (offload_param) and the fp32 master and Adam moments
(offload_optimizer) in files, in one process on the CPU.

It reports, per phase (construction, initialize, each step, an optional
checkpoint save and load, close), the seconds and the peak resident memory
(VmHWM, reset before each phase through /proc/self/clear_refs) beside the
model states' size (16 bytes a parameter: bf16 parameters and gradients,
fp32 master, two fp32 moments). Each step splits into forward+backward
(compute, with stage 3's gathers reading the shard file) and the optimizer
step (the C core's update of the master and moments read and written
through RAM windows, the shard written back). The disk's limit is measured
in the same directory before and after the run (write+fsync, cold read:
bench/offload.py's disk_limit); "disk-bound seconds" is what the step's
file traffic costs at that limit: the master and two moments read and
written, and the shard written, every step.

The model trains on one batch, repeated, so that its loss falls within the
few steps a run can afford (a fresh batch of 64 tokens a step is noisier
than a few steps of learning).

Usage: python bench/beyond_ram.py [--size 3b|1b|300m|tiny] [--steps 4]
       [--dir DIR] [--checkpoint] [--json out.json]
(make bench-beyond-ram runs --size 3b; the checkpoint leg needs the model
states' size again in free disk.)
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, MarkovText  # noqa: E402

from _results import write_json  # noqa: E402
from offload import disk_limit  # noqa: E402

SIZES = {  # name -> GPTConfig: 12 * layers * dim^2 parameters in the blocks
    "3b": GPTConfig(vocab=512, dim=2560, layers=40, heads=20, seq=64),
    "1b": GPTConfig(vocab=512, dim=2048, layers=20, heads=16, seq=64),
    "300m": GPTConfig(vocab=512, dim=1024, layers=24, heads=16, seq=64),
    "tiny": GPTConfig(vocab=512, dim=256, layers=2, heads=4, seq=32),
}
GIB = 1 << 30


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class Phases:
    """Seconds and peak resident memory of each phase."""

    def __init__(self):
        self.rows = []

    def run(self, name, body):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here
        start = time.perf_counter()
        result = body()
        seconds = time.perf_counter() - start
        self.rows.append(dict(phase=name, seconds=seconds, peak_rss=status("VmHWM"),
                              rss_after=status("VmRSS")))
        print(f"  {name}: {seconds:.1f} s, peak RSS {status('VmHWM') / GIB:.2f} GiB",
              flush=True)
        return result


def free_bytes(directory) -> int:
    return shutil.disk_usage(directory).free


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="3b", choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--dir", default=None, help="an existing directory on the disk to use "
                                                "(default: a new one under /tmp)")
    ap.add_argument("--checkpoint", action="store_true",
                    help="also save a checkpoint and load it back (needs the model states' "
                         "size again in free disk)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import zero  # after argparse: --help needs no torch work

    cfg = SIZES[args.size]
    directory = args.dir or tempfile.mkdtemp(prefix="zero-beyond-ram-")
    files_dir = os.path.join(directory, "offload")
    os.makedirs(files_dir, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"disk before: {free_bytes(directory) / GIB:.1f} GiB free in {directory}", flush=True)
    disk_before = disk_limit(directory, 1 << 30)
    phases = Phases()
    base = status("VmRSS")

    def build():
        torch.manual_seed(0)
        with zero.partitioned_init(nvme_path=files_dir):
            return GPT(cfg)
    model = phases.run("construction (partitioned_init, chunks on disk)", build)
    params = sum(p.numel() for p in model.parameters())
    states_bytes = 16 * params
    print(f"{params / 1e9:.2f}B parameters, model states {states_bytes / GIB:.1f} GiB, "
          f"RAM {ram / GIB:.1f} GiB", flush=True)
    offload = {"device": "nvme", "nvme_path": files_dir}
    engine = phases.run("zero.initialize (stage 3, params and states in files)",
                        lambda: zero.initialize(
                            model, optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr),
                            stage=3, precision="bf16", offload_param=offload,
                            offload_optimizer=offload, stage3_param_persistence_threshold=0))
    # one batch, repeated: with a batch of 64 tokens, fresh batches' losses
    # differ by more than a few steps of learning change them (measured on
    # the 0.3B model: 6.35 to 6.56 at lr 3e-6), so only a repeated batch
    # shows the updates working within a few steps
    ids, labels = MarkovText(cfg.vocab, cfg.seq).batch(args.batch, 0)
    losses, split = [], []
    for step in range(args.steps):
        timing = {}

        def train():
            start = time.perf_counter()
            loss = engine(ids, labels)
            engine.backward(loss)
            timing["compute_s"] = time.perf_counter() - start
            start = time.perf_counter()
            engine.step()
            timing["step_s"] = time.perf_counter() - start
            return loss.item()
        losses.append(phases.run(f"step {step + 1}", train))
        split.append(timing)
        print(f"    loss {losses[-1]:.4f}: forward+backward {timing['compute_s']:.1f} s, "
              f"optimizer step {timing['step_s']:.1f} s", flush=True)
    if args.checkpoint:
        ckpt = os.path.join(directory, "ckpt")
        phases.run("save_checkpoint", lambda: engine.save_checkpoint(ckpt))
        phases.run("load_checkpoint", lambda: engine.load_checkpoint(ckpt))
        shutil.rmtree(ckpt)
    summary = engine.memory_summary()
    phases.run("close (model and states given back file-backed)", engine.close)
    disk_after = disk_limit(directory, 1 << 30)
    write_bw = max(d["bytes"] / d["write_s"] for d in (disk_before, disk_after))
    read_bw = max(d["bytes"] / d["read_s"] for d in (disk_before, disk_after))
    # every step reads and writes the master and two moments (12 bytes a
    # parameter) and writes the bf16 shard (2 bytes a parameter)
    read_bytes, write_bytes = 12 * params, 14 * params
    disk_s = read_bytes / read_bw + write_bytes / write_bw
    report(cfg, args, params, states_bytes, ram, base, phases.rows, losses, split,
           (write_bw, read_bw, disk_s), summary)
    if args.json:
        write_json(args.json, dict(size=args.size, params=params, states_bytes=states_bytes,
                                   ram=ram, base_rss=base, phases=phases.rows, losses=losses,
                                   split=split, write_bw=write_bw, read_bw=read_bw,
                                   disk_bound_s=disk_s))
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)


def report(cfg, args, params, states_bytes, ram, base, rows, losses, split, disk, summary):
    write_bw, read_bw, disk_s = disk
    print(f"\nGPT of {params / 1e9:.2f}B parameters (dim {cfg.dim}, {cfg.layers} layers, "
          f"seq {cfg.seq}, batch {args.batch}), bf16, AdamW, stage 3, one process; "
          f"model states {states_bytes / GIB:.1f} GiB = {states_bytes / ram:.2f}x this "
          f"machine's {ram / GIB:.1f} GiB of RAM")
    print(f"disk: write+fsync {write_bw / GIB:.2f} GiB/s, cold read {read_bw / GIB:.2f} GiB/s "
          f"(best of before and after); a step's file traffic at that limit: {disk_s:.1f} s")
    print(f"{'phase':<56}{'seconds':>9}{'peak RSS GiB':>14}{'/ states':>10}")
    print("-" * 89)
    for row in rows:
        print(f"{row['phase']:<56}{row['seconds']:>9.1f}{row['peak_rss'] / GIB:>14.2f}"
              f"{row['peak_rss'] / states_bytes:>10.3f}")
    worst = max(row["peak_rss"] for row in rows)
    print(f"\npeak RSS over every phase: {worst / GIB:.2f} GiB = {worst / states_bytes:.3f} of "
          f"the model states (process before the model: {base / GIB:.2f} GiB)")
    print("losses: " + ", ".join(f"{x:.4f}" for x in losses))
    for i, t in enumerate(split):
        print(f"step {i + 1}: forward+backward {t['compute_s']:.1f} s, optimizer step "
              f"{t['step_s']:.1f} s (disk-bound {disk_s:.1f} s: "
              f"{disk_s / t['step_s']:.0%} of the disk limit)")
    print(f"engine.memory_summary(): params in files "
          f"{summary['params_offloaded'] / GIB:.1f} GiB, optimizer states in files "
          f"{summary['offloaded'] / GIB:.1f} GiB, in RAM "
          f"{summary['model_states'] / GIB:.2f} GiB")


if __name__ == "__main__":
    main()

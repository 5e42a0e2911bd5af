"""The largest GPT (examples/gpt.py) each stage-3 offload setting lets one
rank hold, estimated with zero.settings_that_fit (model states, plus its
rule for buckets and gathered units; activations are not counted), for a
machine's GPU memory, host memory and disk. The model is built on the meta
device, so any size is sized in a moment; depth grows in layers of
--dim width.

Usage: python bench/largest_model.py [--device-memory 141e9] [--host-memory 128GiB]
       [--disk 64GiB] [--dim 8192] [--world-size 1]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import zero  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

SETTINGS = [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "cpu"),
            ("nvme", "nvme")]


def size(text: str) -> float:
    units = {"GIB": 2**30, "GB": 1e9, "TIB": 2**40, "TB": 1e12}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return float(text[:-len(unit)]) * scale
    return float(text)


def gpt(layers, dim):
    with torch.device("meta"):
        return GPT(GPTConfig(vocab=32768, dim=dim, layers=layers, heads=dim // 128, seq=2048))


def fits(layers, setting, args):
    model = gpt(layers, args.dim)
    table = zero.settings_that_fit(model, args.world_size, device_memory=args.device_memory,
                                   host_memory=args.host_memory, disk=args.disk,
                                   precision="bf16")
    row = next(r for r in table if r["stage"] == 3 and
               (r["offload_optimizer"], r["offload_param"]) == setting)
    return row["fits"], sum(p.numel() for p in model.parameters())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-memory", type=size, default=141e9)
    ap.add_argument("--host-memory", type=size, default=128 * 2**30)
    ap.add_argument("--disk", type=size, default=64 * 2**30)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--world-size", type=int, default=1)
    args = ap.parse_args(argv)
    print(f"GPU {args.device_memory / 1e9:.0f} GB, host {args.host_memory / 2**30:.0f} GiB, "
          f"disk {args.disk / 2**30:.0f} GiB, {args.world_size} rank(s), bf16 AdamW, "
          f"stage 3, layers of width {args.dim}")
    print(f"{'offload_optimizer':<19}{'offload_param':<15}{'layers':>7}{'parameters':>13}")
    for setting in SETTINGS:
        lo, hi = 0, 1
        while fits(hi, setting, args)[0]:  # double until it does not fit
            lo, hi = hi, hi * 2
        while lo + 1 < hi:  # the last that fits lies in [lo, hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid, setting, args)[0] else (lo, mid)
        params = fits(lo, setting, args)[1] if lo else 0
        print(f"{setting[0]:<19}{setting[1]:<15}{lo:>7}{params / 1e9:>12.2f}B")


if __name__ == "__main__":
    main()

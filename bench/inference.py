"""ZeRO-Inference on this machine: a HuggingFace GPT-2 generating greedily
through zero.inference at stage 3, its weights gathered whole once
(engine.generate's hybrid engine), or streamed unit by unit for every
token's forward (gather="units", what a model too large to gather does)
from the engine's memory or from files (offload_param "nvme"), beside the
plain model's generate, in one run.

For the streamed rows, each token's forward reads every weight once: the
bytes a second it moves (model bytes x forwards / time) are set against
the limits measured in the same run: the memory copy rate (zero._C's
stream triad; reads of the files come from the page cache when they fit
in RAM, as they do here) and the disk's read rate (bench/offload.py's
disk_limit, the page cache emptied first). What two cores show: the
forward's own compute shares the cores with the copies.

Usage: python bench/inference.py [--layers 12] [--width 768] [--tokens 16]
       [--dir /tmp] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import write_json  # noqa: E402
from offload import disk_limit  # noqa: E402

PROMPT = 8


def gpt2(layers, width):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64),
                     vocab_size=50257, n_positions=256, eos_token_id=None, bos_token_id=None,
                     pad_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def timed(generate, repeat=2):
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = generate()
        times.append(time.perf_counter() - start)
    return min(times), out


def triad_bytes_per_s(n=1 << 25):
    import zero
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        zero._C.stream_triad(a, b, c, 3.0)
        times.append(time.perf_counter() - start)
    return 3 * 4 * n / statistics.median(times)  # two reads and a write of 4 bytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dir", default=None, help="where the nvme row's files go")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(var, None)
    import zero
    torch.set_num_threads(os.cpu_count() or 1)
    directory = tempfile.mkdtemp(prefix="zero-inference-", dir=args.dir)
    prompt = torch.randint(1, 50257, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    plain = gpt2(args.layers, args.width)
    params = sum(p.numel() for p in plain.parameters())
    model_bytes = 4 * params  # fp32
    kwargs = dict(max_new_tokens=args.tokens, do_sample=False)
    rows = {}
    with torch.no_grad():
        rows["plain model"] = timed(lambda: plain.generate(prompt, **kwargs))
    expected = rows["plain model"][1]
    for label, gather, offload in (("zero stage 3, gathered once", "whole", None),
                                   ("zero stage 3, streamed from memory", "units", None),
                                   ("zero stage 3, streamed from files", "units", "nvme")):
        options = {"offload_param": {"device": "nvme", "nvme_path": directory}} \
            if offload else {}
        engine = zero.inference(gpt2(args.layers, args.width), stage=3,
                                stage3_param_persistence_threshold=0, **options)
        rows[label] = timed(lambda: engine.generate(prompt, gather=gather, **kwargs))
        assert torch.equal(rows[label][1], expected), label
        engine.close()
    copy_rate = triad_bytes_per_s()
    disk = disk_limit(directory, min(model_bytes, 1 << 30))
    disk_rate = disk["bytes"] / disk["read_s"]
    shutil.rmtree(directory, ignore_errors=True)
    print(f"GPT-2 {args.layers} layers x {args.width} ({params / 1e6:.0f}M parameters, "
          f"{model_bytes / 2**20:.0f} MiB fp32), greedy, prompt {PROMPT} + {args.tokens} "
          f"tokens, batch 1, {os.cpu_count()} cores; best of 2")
    print(f"limits measured here: memory copy (stream triad) {copy_rate / 1e9:.1f} GB/s, "
          f"disk read {disk_rate / 1e9:.2f} GB/s")
    header = f"{'':<36}{'tokens/s':>10}{'x plain':>9}{'streamed GB/s':>15}{'x copy':>8}"
    print(header + "\n" + "-" * len(header))
    plain_rate = args.tokens / rows["plain model"][0]
    out = {"params": params, "copy_bytes_per_s": copy_rate, "disk_read_bytes_per_s": disk_rate,
           "rows": {}}
    for label, (seconds, _tokens) in rows.items():
        rate = args.tokens / seconds
        streamed = model_bytes * args.tokens / seconds if "streamed" in label else None
        cells = f"{streamed / 1e9:>15.2f}{streamed / copy_rate:>8.2f}" if streamed else \
            f"{'-':>15}{'-':>8}"
        print(f"{label:<36}{rate:>10.2f}{rate / plain_rate:>9.2f}{cells}")
        out["rows"][label] = {"seconds": seconds, "tokens_per_s": rate,
                              "streamed_bytes_per_s": streamed}
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()

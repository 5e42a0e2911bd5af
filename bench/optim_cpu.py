"""CPU optimizer step: zero against torch.optim and DeepSpeedCPUAdam, and
against the memory-bandwidth ceiling measured in the same run.

Two workloads, each over one flat parameter tensor of N elements:
  a. fp32 AdamW: reads p, g, m, v, writes p, m, v (28 bytes per parameter).
  b. the ZeRO-Offload host step: bf16 (or fp16) gradients, multiplied by an
     unscale/clip factor, fp32 AdamW on master weights, updated weights
     written out as bf16/fp16. zero does it in one pass; torch's best
     sequence is upcast-copy, fused AdamW with its grad_scale unscaling,
     cast-copy back; DeepSpeed's is upcast-copy, scale, its step, cast-copy.

The ceiling is the better of two STREAM-triad loops over float32 buffers of
N elements, run by the core's own threads in the same round-robin as the
runners, each counted as STREAM counts (12 bytes an element): a = b + s*c
with non-temporal stores, and a = a + s*c in place (the access pattern of an
optimizer step). "of ceil" gives each rate as a fraction of that bandwidth
divided by the workload's minimal traffic (28 bytes a parameter for both
workloads).

Usage: python bench/optim_cpu.py [--sizes 1M,16M,64M,256M] [--threads 1,2]
       [--json out.json] [--no-deepspeed]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

import zero

from _results import write_json

BYTES_PER_PARAM = 28


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


REPEATS = {"value": None}  # --repeats overrides the size-based default


def repeats_for(n: int) -> int:
    if REPEATS["value"]:
        return REPEATS["value"]
    return max(5, min(30, int(4e8 // max(n, 1))))


def time_interleaved(steps: dict, repeats: int) -> dict:
    """Median seconds of each step, run round-robin (one of each per round)
    after a warm-up round, so that the machine's slow moments (it is shared)
    fall on every runner alike."""
    samples = {name: [] for name in steps}
    for round_index in range(repeats + 1):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if round_index:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def triad_setup(n: int, in_place: bool):
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    if in_place:
        return lambda: zero._C.stream_triad(a, None, c, 1e-6)
    return lambda: zero._C.stream_triad(a, b, c, 3.0)


TRIADS = ("triad (non-temporal)", "triad (in place)")


# ---- workload a: fp32 AdamW ------------------------------------------------

def adamw_fp32_runners(n: int, use_deepspeed: bool):
    """name -> (setup() -> step callable) for the fp32 AdamW step."""
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def param_with_grad():
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        return p

    def zero_setup():
        p = param_with_grad()
        opt = zero.optim.AdamW([p], **hp)
        opt.step()  # gradients now live in the flat buffer: no copy per step
        return opt.step

    def torch_setup(**kw):
        def setup():
            opt = torch.optim.AdamW([param_with_grad()], **hp, **kw)
            return opt.step
        return setup

    runners = {
        "zero.optim.AdamW": zero_setup,
        "torch AdamW foreach": torch_setup(foreach=True),
        "torch AdamW fused": torch_setup(fused=True),
    }
    if use_deepspeed:
        def deepspeed_setup():
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam([param_with_grad()], adamw_mode=True, **hp)
            return opt.step
        runners["DeepSpeedCPUAdam"] = deepspeed_setup
    return runners


# ---- workload b: the mixed-precision host step -------------------------------

def mixed_runners(n: int, half: torch.dtype, use_deepspeed: bool):
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    loss_scale = 1024.0

    def zero_setup():
        p16 = torch.nn.Parameter(torch.randn(n).to(half))
        opt = zero.optim.AdamW([p16], **hp)
        p16.grad = (torch.randn(n) * loss_scale).to(half)
        opt.step(grad_scale=1 / loss_scale)  # grads now in the flat buffer
        return lambda: opt.step(grad_scale=1 / loss_scale)

    def torch_setup():
        master = torch.nn.Parameter(torch.randn(n))
        p16 = master.detach().to(half)
        g16 = (torch.randn(n) * loss_scale).to(half)
        master.grad = torch.empty(n)
        opt = torch.optim.AdamW([master], fused=True, **hp)
        # what torch.amp.GradScaler hands a fused optimizer: unscaling is
        # folded into the fused kernel
        opt.grad_scale = torch.tensor(loss_scale)
        opt.found_inf = torch.tensor(0.0)

        def step():
            master.grad.copy_(g16)
            opt.step()
            p16.copy_(master.detach())
        return step

    runners = {"zero.optim.AdamW": zero_setup,
               "torch: upcast, fused AdamW(grad_scale), cast": torch_setup}
    if use_deepspeed:
        def deepspeed_setup():
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            master = torch.nn.Parameter(torch.randn(n))
            p16 = master.detach().to(half)
            g16 = (torch.randn(n) * loss_scale).to(half)
            master.grad = torch.empty(n)
            opt = DeepSpeedCPUAdam([master], adamw_mode=True, **hp)

            def step():
                # DeepSpeedCPUAdam takes fp32 gradients and no scale factor
                master.grad.copy_(g16).mul_(1 / loss_scale)
                opt.step()
                p16.copy_(master.detach())
            return step
        runners["DeepSpeedCPUAdam: upcast, scale, step, cast"] = deepspeed_setup
    return runners


def deepspeed_status() -> tuple[bool, str]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = torch.zeros(8)
        DeepSpeedCPUAdam([p]).step()  # builds its op on first use
        import deepspeed
        return True, f"deepspeed {deepspeed.__version__}"
    except Exception as exc:  # report why, do not hide it
        return False, f"DeepSpeedCPUAdam unavailable: {type(exc).__name__}: {exc}"


def measure(runners: dict, n: int, interleave: bool) -> tuple[float, dict]:
    """(ceiling bytes/s, {runner: params/s}). Interleaved when all runners
    fit in memory at once; else one runner at a time, each beside the
    triads."""
    repeats = repeats_for(n)
    triads = lambda: {name: triad_setup(n, name == TRIADS[1]) for name in TRIADS}  # noqa: E731
    if interleave:
        seconds = time_interleaved({**triads(), **{k: s() for k, s in runners.items()}},
                                   repeats)
    else:
        seconds, triad_times = {}, {name: [] for name in TRIADS}
        for name, setup in runners.items():
            group = time_interleaved({**triads(), name: setup()}, repeats)
            seconds[name] = group[name]
            for t in TRIADS:
                triad_times[t].append(group[t])
            gc.collect()
        seconds.update({t: statistics.median(v) for t, v in triad_times.items()})
    gc.collect()
    ceiling = max(12 * n / seconds.pop(t) for t in TRIADS)
    return ceiling, {name: n / s for name, s in seconds.items()}


def fmt_rate(x: float) -> str:
    return f"{x / 1e9:.3f}G" if x >= 1e9 else f"{x / 1e6:.1f}M"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,16M,64M,256M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--half", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--repeats", type=int, help="timed rounds per size (default: by size)")
    ap.add_argument("--interleave-limit-gb", type=float, default=10.0,
                    help="run all runners round-robin when they fit in this much memory")
    args = ap.parse_args(argv)
    REPEATS["value"] = args.repeats
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    half = getattr(torch, args.half)

    use_ds, ds_note = (False, "skipped (--no-deepspeed)") if args.no_deepspeed \
        else deepspeed_status()
    info = zero.cpu_info()
    print(f"zero {zero.__version__}: SIMD path {info['simd']} ({info['features']}); "
          f"torch {torch.__version__}; {ds_note}")
    print("rates in parameters per second; 'of ceil' = rate / (ceiling bandwidth / "
          f"{BYTES_PER_PARAM} B)\n")
    header = f"{'workload':<9} {'params':>6} {'thr':>3} {'ceil GB/s':>10} " \
             f"{'runner':<46} {'params/s':>9} {'of ceil':>7} {'zero/this':>9}"
    print(header)
    print("-" * len(header))
    results = []
    for n in sizes:
        for t in threads:
            zero.set_num_threads(t)
            torch.set_num_threads(t)
            for workload, runners in (("a fp32", adamw_fp32_runners(n, use_ds)),
                                      (f"b {args.half[:4]}", mixed_runners(n, half, use_ds))):
                # each runner holds about 20 bytes a parameter, the triads 24
                interleave = n * (20 * len(runners) + 24) < args.interleave_limit_gb * 2**30
                bw, rates = measure(runners, n, interleave)
                ceiling = bw / BYTES_PER_PARAM
                ours = rates["zero.optim.AdamW"]
                for name, rate in rates.items():
                    print(f"{workload:<9} {n >> 20:>5}M {t:>3} {bw / 1e9:>10.1f} {name:<46} "
                          f"{fmt_rate(rate):>9} {rate / ceiling:>7.1%} {ours / rate:>8.2f}x")
                    results.append(dict(workload=workload, params=n, threads=t,
                                        ceiling_bytes_per_s=bw, runner=name,
                                        params_per_s=rate, fraction_of_ceiling=rate / ceiling,
                                        zero_over_this=ours / rate))
            print()
    if args.json:
        write_json(args.json, dict(cpu=info, torch=torch.__version__, deepspeed=ds_note,
                                   command=" ".join(sys.argv), results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

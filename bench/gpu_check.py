"""The GPU check, for a session with a GPU and a few minutes: uses the
zero._C built beside it, or, where there is none for this Python (the
device's image has another Python than the build machine), builds it in
place first (a C compiler and, for the kernels, nvcc), runs tests/gpu (the kernels, and the engine's stages 0-3 against torch),
times the flat Adam kernel against torch's fused AdamW and against the
device's copy bandwidth measured in the same run, then a short training
loop of examples/gpt.py's GPT at 30M (launch-bound) and 235M parameters
under the engine (stages 0-3, bf16; stage 2 with the states offloaded to
host memory, with and without delayed_update; stage 3 with the parameters
offloaded too) beside plain torch (autocast bf16, fused AdamW) and FSDP2
on one GPU (bf16 compute, fp32 master, fused AdamW), and the offloaded
runners against their bounds (forward+backward alone, the host's memory
bandwidth by the C core's stream triad, the PCIe copy bandwidth); prints the
tables and writes JSON (and, with --profile, torch.profiler tables of the
30M steps) under $OUT when it is set.

Two workloads over one flat parameter tensor of N elements (64M, 256M, 1G):
  fp32   fp32 gradients; torch: AdamW(fused=True).step().
  mixed  bf16 gradients and a bf16 copy-out of the updated parameters;
         torch's best sequence: upcast the gradient into p.grad, fused
         AdamW, cast-copy the parameters out.
Both move 28 bytes a parameter at least: read p, g, m, v and write p, m, v
(fp32: 16 + 12; mixed: 4 + 2 + 8 read, 12 + 2 written). "of copy" divides
that traffic by the time and by the bandwidth of a device-to-device copy
of a 1 GiB buffer (2 bytes moved per byte copied).

Each time is the median over rounds in which every runner runs `--steps`
back-to-back steps between two CUDA events (so the CPU's launch cost is
hidden as it is in training), the runners taking turns within a round.

Usage: python bench/gpu_check.py [--sizes 64M,256M,1G] [--rounds 7] [--steps 10]
       [--train-steps 30] [--train-models 30M,235M] [--profile] [--skip-tests]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402

try:
    import zero  # noqa: E402
except ImportError:  # no zero._C carried here: build it in place
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT,
                   check=True)
    import zero  # noqa: E402
from gpt import GPT, GPTConfig, MarkovText  # noqa: E402
from zero import _C
from zero.step import _cuda  # noqa: E402

BYTES_PER_PARAM = 28
HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def parse_size(text):
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def run_tests():
    start = time.time()
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "-rs", "tests/gpu"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
                             timeout=300)  # a hang must not spend the whole device lease
    except subprocess.TimeoutExpired as hung:
        text = (hung.stdout or b"")[-4000:]
        print(text.decode() if isinstance(text, bytes) else text)
        print("tests/gpu did not finish in 300 s; timing anyway")
        return dict(returncode=-1, summary="timed out after 300 s", seconds=300)
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
    print(out.stdout[-4000:] if out.returncode else tail)
    return dict(returncode=out.returncode, summary=tail, seconds=round(time.time() - start, 1))


def timed(fn, steps):
    """Seconds per step of `steps` back-to-back calls, by CUDA events."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / steps


def interleaved(runners, rounds, steps):
    samples = {name: [] for name in runners}
    for round_index in range(rounds + 1):
        for name, fn in runners.items():
            seconds = timed(fn, steps)
            if round_index:  # round 0 warms up
                samples[name].append(seconds)
    return {name: statistics.median(s) for name, s in samples.items()}


def copy_bandwidth(rounds, steps):
    n = (1 << 30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    seconds = interleaved({"copy": lambda: dst.copy_(src)}, rounds, steps)["copy"]
    return 2 * n * 4 / seconds  # the buffers go with this frame


def workload(n, mixed, rounds, steps):
    """(our seconds, torch's seconds) per step over n parameters."""
    g = torch.Generator(device="cuda").manual_seed(n)
    p = torch.randn(n, device="cuda", generator=g)
    grad = torch.randn(n, device="cuda", generator=g).mul_(1e-3)
    if mixed:
        grad = grad.bfloat16()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    copy = torch.empty(n, dtype=torch.bfloat16, device="cuda") if mixed else None
    step = torch.zeros(1, device="cuda")

    def ours():
        _cuda.adam_step(p, grad, m, v, step=step, copy_out=copy, **HP)

    param = torch.nn.Parameter(p.clone())
    param.grad = torch.empty_like(param) if mixed else grad.clone()
    torch_opt = torch.optim.AdamW([param], fused=True, **HP)
    torch_copy = torch.empty(n, dtype=torch.bfloat16, device="cuda") if mixed else None

    def theirs():
        if mixed:
            param.grad.copy_(grad)
        torch_opt.step()
        if mixed:
            torch_copy.copy_(param.detach())

    result = interleaved({"ours": ours, "torch": theirs}, rounds, steps)
    # the buffers go with this frame; the caller empties torch's cache
    return result["ours"], result["torch"]


TRAIN_MODELS = {  # name: (config, batch)
    "30M": (GPTConfig.about_30m(), 16),  # 2048 tokens a step: launch-bound on an H200
    # 32768*1024 tied embedding + 16 blocks of 12*1024^2: about 235M parameters,
    # 4096 tokens a step: the matrix products outweigh the launches
    "235M": (GPTConfig(vocab=32768, dim=1024, layers=16, heads=16, seq=512), 8),
}


def one_rank_group():
    """FSDP2 needs a process group (the engine makes and drops its own);
    the caller destroys this one before the engine's runs."""
    import torch.distributed as dist
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0,
                                world_size=1)


def train_loop(runner, steps, model_name="30M", profile=None):
    """ms per step (median of `steps` after 3 warm-up steps), the last
    loss and the peak GPU memory above what was allocated before the model
    was built (what this runner took), for one runner: "torch", "zero<stage>"
    or "zero<stage> offload". With `profile` (a list), the last 5 steps run
    under torch.profiler and its table (by self CPU time) is appended."""
    torch.manual_seed(0)
    cfg, batch = TRAIN_MODELS[model_name]
    data = MarkovText(cfg.vocab, cfg.seq)
    gc.collect()  # an earlier runner's tensors freed before the baseline is read
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    model = GPT(cfg).cuda()
    torch.cuda.reset_peak_memory_stats()
    engine = None
    if runner == "fwd+bwd":  # the bound the offloaded runners are held to
        def step(ids, labels):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss
    elif runner in ("torch", "fsdp2"):
        if runner == "fsdp2":
            # torch's FSDP2 on one GPU: bf16 parameters in compute, fp32
            # master and fp32 gradient reduction, each block a unit
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            one_rank_group()
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=True)
        # plain torch: fp32 parameters under bf16 autocast
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=runner == "torch")

        def step(ids, labels):
            with autocast:
                loss = model(ids, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    elif runner == TP_PP_RUNNER:
        engine, step = tensor_and_pipeline_of_one(model, "cuda")
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
        engine = zero.initialize(model, optimizer=opt, stage=int(runner[4]), precision="bf16",
                                 gradient_clipping=1.0, **offload_options(runner))

        def step(ids, labels):
            loss = engine(ids, labels)
            engine.backward(loss)
            engine.step()
            return loss
    times, loss = [], None
    for i in range(steps + 3):
        ids, labels = (t.cuda() for t in data.batch(batch, i))
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(ids, labels)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    if profile is not None:
        from torch.profiler import ProfilerActivity
        with torch.profiler.profile(activities=[ProfilerActivity.CPU,
                                                ProfilerActivity.CUDA]) as prof:
            for i in range(5):
                step(*(t.cuda() for t in data.batch(batch, steps + 3 + i)))
            torch.cuda.synchronize()
        profile.append(f"== {runner}, {model_name}, 5 steps ==\n" + prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=25))
    result = dict(runner=runner, model=model_name, ms=statistics.median(times) * 1e3,
                  loss=loss.item(),
                  peak_mib=(torch.cuda.max_memory_allocated() - baseline) / 2**20,
                  before_mib=baseline / 2**20,  # grows if an earlier runner leaked
                  params=sum(p.numel() for p in model.parameters()) if engine is None
                  else sum(fg.numel for fg in engine.groups),
                  path=engine.step_path.name if engine else f"{runner}, fused AdamW")
    if engine is not None:
        engine.close()
    return result  # the model and its states go with this frame


# issue 23's cost of the tensor- and pipeline-parallel code paths on one
# GPU: zero stage 1 with the model split over a tp of 1 (DTensor parameters
# and styles) and cut into a pipeline of 1 (torch's 1F1B schedule), beside
# "zero1" (target: within 3%)
TP_PP_RUNNER = "zero1 tp1 pp1"


def tensor_and_pipeline_of_one(model, device_type):
    """(engine, step) for TP_PP_RUNNER on a mesh (pp, dp_shard, tp) of 1 x 1
    x 1 (one_rank_group's; destroyed by the caller after the run)."""
    from torch.distributed.device_mesh import init_device_mesh
    one_rank_group()
    mesh = init_device_mesh(device_type, (1, 1, 1), mesh_dim_names=("pp", "dp_shard", "tp"))
    stage = zero.parallel.split_gpt(model, mesh["pp"])
    zero.parallel.parallelize_gpt(stage, mesh["tp"])
    opt = torch.optim.AdamW(stage.parameters(), lr=3e-4, weight_decay=0.01)
    engine = zero.initialize(stage, optimizer=opt, stage=1, precision="bf16",
                             gradient_clipping=1.0, mesh=mesh)
    pipe = zero.parallel.pipeline_schedule(engine, mesh["pp"], 1, zero.parallel.gpt_loss)

    def step(ids, labels):
        losses = []
        pipe.step(ids, target=labels, losses=losses)
        engine.step()
        return sum(losses)
    return engine, step


# the offloaded runners: "zero2 offload" (states on the host), "... delayed"
# (offload_optimizer.delayed_update), "zero3 offload params" (parameters
# and states on the host)
OFFLOAD_RUNNERS = ("zero2 offload", "zero2 offload delayed", "zero3 offload params",
                   "zero3 offload params delayed")


def offload_options(runner):
    options = {}
    if "offload" in runner:
        options["offload_optimizer"] = {"device": "cpu", "delayed_update": "delayed" in runner}
    if "params" in runner:
        options["offload_param"] = {"device": "cpu"}
    return options


def host_bandwidth():
    """Bytes a second of the host's memory: the C core's stream triad over
    256 MiB buffers (3 buffers moved), the best of 5."""
    n = 64 << 20
    a, b, c = (torch.ones(n) for _ in range(3))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        _C.stream_triad(a, b, c, 0.5)
        best = min(best, time.perf_counter() - start)
    return 3 * 4 * n / best


def pcie_bandwidth():
    """(host to device, device to host) bytes a second: a 1 GiB copy
    between page-locked host memory and the GPU, the best of 5."""
    n = (1 << 30) // 4
    host = torch.empty(n, pin_memory=True)
    device = torch.empty(n, device="cuda")
    speeds = []
    for dst, src in ((device, host), (host, device)):
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        speeds.append(4 * n / best)
    return tuple(speeds)


def offload_bounds(training, model_name, host_bw, pcie):
    """Issue 21's targets for the offloaded runners: the optimizer-offload
    iteration against max(forward+backward, the host update at the host's
    memory bandwidth: 28 bytes a parameter, bf16 gradients in and
    parameters out); parameter offload's against max(forward+backward,
    the parameters' bus traffic: 2 bytes a parameter up for the forward,
    up again for the backward, and the gradients' 2 down, at one rank)."""
    rows = {r["runner"]: r for r in training if r["model"] == model_name}
    fwdbwd = rows.get("fwd+bwd", {}).get("ms", float("nan"))
    params = rows.get("fwd+bwd", {}).get("params", 0)
    update_ms = 28 * params / host_bw * 1e3
    bus_ms = (4 * params / pcie[0] + 2 * params / pcie[1]) * 1e3
    lines = []
    for runner in OFFLOAD_RUNNERS:
        if runner not in rows:
            continue
        bound = max(fwdbwd, update_ms, bus_ms if "params" in runner else 0.0)
        lines.append(f"{runner:<30} {rows[runner]['ms']:>9.2f} {bound:>9.2f} "
                     f"{rows[runner]['ms'] / bound:>7.2f}x")
    return fwdbwd, update_ms, bus_ms, lines


def print_table(header: str, lines: list):
    print(header)
    print("-" * len(header))
    for line in lines:
        print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64M,256M,1G")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--train-models", default="30M,235M")
    ap.add_argument("--profile", action="store_true",
                    help="profile 5 steps of torch, fsdp2, zero0 and zero3 on the 30M model "
                         "(tables to $OUT/profile.txt)")
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()

    try:  # the driver and GPU, for the log
        print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.strip())
    except (OSError, subprocess.TimeoutExpired) as error:
        print(f"nvidia-smi: {error}")
    _C.cuda_available()  # loads the driver, so cuda_info() has its version
    info = _C.cuda_info()
    print(f"zero._C: {info}")
    if not torch.cuda.is_available() or not info["available"]:
        print("no usable GPU: nothing to check", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__} (CUDA {torch.version.cuda})")
    tests = None if args.skip_tests else run_tests()

    bandwidth = copy_bandwidth(args.rounds, args.steps)
    rows = []
    for size in args.sizes.split(","):
        n = parse_size(size)
        for mixed in (False, True):
            ours, theirs = workload(n, mixed, args.rounds, args.steps)
            torch.cuda.empty_cache()  # up to 1G parameters' buffers freed by now
            achieved = BYTES_PER_PARAM * n / ours
            rows.append(dict(workload="mixed" if mixed else "fp32", size=size, n=n,
                             ours_ms=ours * 1e3, torch_ms=theirs * 1e3,
                             speedup=theirs / ours, ours_gbs=achieved / 1e9,
                             of_copy=achieved / bandwidth))

    print(f"\ndevice-to-device copy: {bandwidth / 1e9:.0f} GB/s "
          f"(1 GiB, 2 bytes moved per byte)\n")
    print_table(f"{'workload':<8} {'N':>6} {'zero ms':>9} {'torch ms':>9} {'torch/zero':>10} "
                f"{'zero GB/s':>10} {'of copy':>8}",
                [f"{r['workload']:<8} {r['size']:>6} {r['ours_ms']:>9.3f} {r['torch_ms']:>9.3f} "
                 f"{r['speedup']:>10.2f} {r['ours_gbs']:>10.0f} {r['of_copy']:>8.0%}"
                 for r in rows])

    host_bw, pcie = host_bandwidth(), pcie_bandwidth()
    training, profiles = [], []
    for model_name in args.train_models.split(","):
        rows_before = len(training)
        for runner in ("torch", "fwd+bwd", "fsdp2", "zero0", "zero1", "zero2", "zero3",
                       *OFFLOAD_RUNNERS, TP_PP_RUNNER):
            if runner == "zero0" and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()  # fsdp2's: the engine makes its own
            wanted = args.profile and model_name == "30M" and runner in ("torch", "fsdp2",
                                                                          "zero0", "zero3")
            try:
                training.append(train_loop(runner, args.train_steps, model_name,
                                           profiles if wanted else None))
            except Exception as error:  # one runner's failure must not lose the others' rows
                print(f"{runner} ({model_name}) failed: {type(error).__name__}: {error}")
                training.append(dict(runner=runner, model=model_name, ms=float("nan"),
                                     loss=float("nan"), peak_mib=float("nan"),
                                     before_mib=float("nan"),
                                     path=f"failed: {error}"[:200]))
            if runner == TP_PP_RUNNER and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()  # its mesh's
            torch.cuda.empty_cache()
        cfg, batch = TRAIN_MODELS[model_name]
        base = training[rows_before]["ms"]
        print(f"\ntraining: {model_name} GPT, batch {batch} x {cfg.seq} tokens, bf16, "
              f"clip 1.0, median of {args.train_steps} steps\n")
        print_table(f"{'runner':<13} {'ms/step':>9} {'torch/zero':>10} {'loss':>8} "
                    f"{'peak MiB':>9} {'before':>7}  step",
                    [f"{r['runner']:<13} {r['ms']:>9.2f} {base / r['ms']:>10.2f} "
                     f"{r['loss']:>8.4f} {r['peak_mib']:>9.0f} {r['before_mib']:>7.0f}  "
                     f"{r['path']}" for r in training[rows_before:]])
        fwdbwd, update_ms, bus_ms, lines = offload_bounds(training, model_name, host_bw, pcie)
        print(f"\noffload bounds, {model_name}: forward+backward {fwdbwd:.2f} ms; host update "
              f"at {host_bw / 1e9:.0f} GB/s {update_ms:.2f} ms; parameter bus traffic at "
              f"{pcie[0] / 1e9:.0f}/{pcie[1] / 1e9:.0f} GB/s up/down {bus_ms:.2f} ms "
              "(targets: 1.15x for the states, 1.3x for the parameters)\n")
        print_table(f"{'runner':<30} {'ms/step':>9} {'bound ms':>9} {'ratio':>8}", lines)
        by_runner = {r["runner"]: r["ms"] for r in training[rows_before:]}
        print(f"\n{TP_PP_RUNNER} / zero1, {model_name}: "
              f"{by_runner[TP_PP_RUNNER] / by_runner['zero1']:.3f} (issue 23's target: <= 1.03)")

    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "gpu_check.json"
        path.write_text(json.dumps(dict(
            device=device, torch=torch.__version__, zero_cuda=info, tests=tests,
            copy_gbs=bandwidth / 1e9, bytes_per_param=BYTES_PER_PARAM, rows=rows,
            training=training, host_gbs=host_bw / 1e9,
            pcie_gbs=[x / 1e9 for x in pcie],
            command=" ".join([Path(sys.executable).name, *sys.argv])), indent=2))
        print(f"\nwrote {path}")
        if profiles:
            (Path(out_dir) / "profile.txt").write_text("\n\n".join(profiles))
    return 1 if tests and tests["returncode"] else 0


if __name__ == "__main__":
    sys.exit(main())

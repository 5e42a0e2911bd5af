"""Engine-against-torch cases that do not care where the step runs: run by
tests/gpu/test_engine.py (the CUDA step, on a GPU or on the emulated
driver) and tests/test_step_paths.py (the torch-op step on the CPU).

Each case trains a small model with embedding, GELU, LayerNorm and a
residual through zero.initialize in one process (world size 1), and the
same model with the torch optimizer it names, on the same device, on the
same random batches, then compares every parameter.

Tolerances: fp32 results within 1e-5 normwise relative error after 6
updates. Forward and backward are the same torch ops on both sides; the
updates differ by rounding only (one fused formula against torch's
sequence of ops, the clip coefficient folded into the gradient scale), a
few ulps (1e-7) a step, which training can amplify tenfold over six steps.
bf16 training is compared with the same mixed precision written in torch
(a bf16 model, fp32 masters updated by torch's AdamW), and its bf16
parameters must be the fp32 master rounded to bf16, bit for bit.
"""
import contextlib
import copy
import os
import subprocess
import sys
import textwrap

import torch
from torch import nn

import zero
from conftest import max_rel_error

STEPS = 6
ACCUMULATION = 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.LayerNorm(33),
                                  nn.Linear(33, 16))
        self.head = nn.Linear(16, 50)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.body(h))


def no_launcher(monkeypatch):
    """One process with no launcher variables: the engine makes its own
    in-memory group."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@contextlib.contextmanager
def user_group_of_one(monkeypatch):
    """A default process group of one rank that the test made itself (as a
    user's script would), with no launcher variables."""
    import torch.distributed as dist
    no_launcher(monkeypatch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def apart_on_the_cpu(_device, offload):
    """The placement rule the offload tests put in place of the real one
    (zero.step._step_path.states_off_device, zero.offload._param_staging.
    params_off_device): states or a shard offloaded to "cpu" or "nvme" are
    kept apart from a CPU model as from a GPU model's, so the copies a GPU
    model's engine makes run between separate buffers on the CPU."""
    return offload.device in ("cpu", "nvme")


_REAL_PLACEMENT = {}


def place_apart(params: bool, states: bool):
    """In a worker process (no monkeypatch there): apart_on_the_cpu for the
    parameter shard and/or the states, the real rule for the other; the
    real rules are kept from the first call, so runs can alternate."""
    import zero.offload._param_staging as param_staging
    import zero.step._step_path as step_path
    real_params = _REAL_PLACEMENT.setdefault("params", param_staging.params_off_device)
    real_states = _REAL_PLACEMENT.setdefault("states", step_path.states_off_device)
    param_staging.params_off_device = apart_on_the_cpu if params else real_params
    step_path.states_off_device = apart_on_the_cpu if states else real_states


def offload_options(directory, params=None, states=None, chunk_elements=1024):
    """initialize's offload_param / offload_optimizer blocks for the
    devices given ("cpu" or "nvme"; None leaves the block out), files under
    `directory`."""
    options = {}
    if params is not None:
        options["offload_param"] = {"device": params, "nvme_path": str(directory)}
    if states is not None:
        options["offload_optimizer"] = {"device": states, "nvme_path": str(directory),
                                        "chunk_elements": chunk_elements}
    return options


def pair(device, seed=0):
    """The model on `device` and an identical reference copy."""
    torch.manual_seed(seed)
    model = Net().to(device)
    return model, copy.deepcopy(model)


def batches(device, count, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 50, (4, 7), generator=g).to(device),
             torch.randint(0, 50, (4, 7), generator=g).to(device)) for _ in range(count)]


def loss_of(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, 50), targets.reshape(-1))


def make_optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)
    if name == "adamw_maximize":  # the loss is then ascended: a sign the step must carry
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, maximize=True)
    if name == "lion":  # zero.optim's: on the CPU only (its reference is the C core)
        return zero.optim.Lion(params, lr=1e-3, weight_decay=0.1)
    if name == "adam_amsgrad":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.01, amsgrad=True)
    if name == "sgd":  # no momentum: no state at all
        return torch.optim.SGD(params, lr=0.1)
    if name == "sgd_nesterov":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.05, lr_decay=0.01, weight_decay=0.01)
    raise ValueError(name)


def reference_run(ref, optimizer, data, clip):
    """Plain torch: accumulate ACCUMULATION micro-batches (each loss divided
    by ACCUMULATION, as the engine averages), clip, step."""
    for i, (tokens, targets) in enumerate(data):
        (loss_of(ref(tokens), targets) / ACCUMULATION).backward()
        if (i + 1) % ACCUMULATION == 0:
            if clip:
                nn.utils.clip_grad_norm_(ref.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()


def engine_run(engine, data):
    for tokens, targets in data:
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()


def compare_with_torch(device, stage, optimizer_name="adamw", clip=0.5, tolerance=1e-5,
                       build="on device", **options):
    """fp32 training under the engine against torch; returns the engine
    (closed) for further checks. build: "on device" (the model is moved
    before initialize), "on cpu" (initialize(device=) moves it) or
    "partitioned" (built under zero.partitioned_init on the CPU, moved by
    initialize(device=) one parameter at a time). options: initialize's."""
    model, ref = pair(device if build == "on device" else "cpu")
    ref = ref.to(device)
    if build == "partitioned":
        torch.manual_seed(0)
        with zero.partitioned_init():
            model = Net()
    engine = zero.initialize(model, optimizer=make_optimizer(optimizer_name, model.parameters()),
                             stage=stage, gradient_accumulation_steps=ACCUMULATION,
                             gradient_clipping=clip, stage3_param_persistence_threshold=0,
                             device=None if build == "on device" else device, **options)
    data = batches(device, STEPS * ACCUMULATION)
    engine_run(engine, data)
    reference_run(ref, make_optimizer(optimizer_name, ref.parameters()), data, clip)
    full = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        assert full[name].device.type == "cpu", name  # loadable anywhere
        error = max_rel_error(full[name], value.cpu())
        assert error <= tolerance, f"stage {stage} {optimizer_name}: {name} off by {error:.2e}"
    assert engine.global_steps == STEPS
    engine.close()
    return engine


def mixed_precision_reference_run(ref, data):
    """What bf16 training under the engine computes, written with torch:
    the model in bf16 (gradients accumulate in bf16 in .grad), an fp32
    master copy of the fp32 model's own values (not rounded to bf16 first)
    that torch's AdamW updates from the gradients upcast and averaged, and
    the bf16 parameters copied back from the master. Returns the masters
    by name."""
    masters = {n: nn.Parameter(p.detach().float().clone()) for n, p in ref.named_parameters()}
    ref.to(torch.bfloat16)
    params = dict(ref.named_parameters())
    optimizer = make_optimizer("adamw", masters.values())
    for i, (tokens, targets) in enumerate(data):
        loss_of(ref(tokens), targets).backward()
        if (i + 1) % ACCUMULATION == 0:
            for name, p in params.items():
                masters[name].grad = p.grad.float() * (1.0 / ACCUMULATION)
                p.grad = None
            optimizer.step()
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(masters[name])
    return masters


def bf16_matches_mixed_precision_torch(device, stage):
    model, ref = pair(device)
    engine = zero.initialize(model, optimizer=make_optimizer("adamw", model.parameters()),
                             stage=stage, precision="bf16",
                             gradient_accumulation_steps=ACCUMULATION,
                             stage3_param_persistence_threshold=0)
    data = batches(device, STEPS * ACCUMULATION)
    engine_run(engine, data)
    masters = mixed_precision_reference_run(ref, data)
    full = engine.full_state_dict()
    for name, value in masters.items():
        # 1e-4: as fp32 (1e-5), plus a bf16 parameter that rounds the other
        # way after an ulp of difference in its master, a rare event
        assert max_rel_error(full[name], value.detach().cpu()) <= 1e-4, name
    for name, p in model.named_parameters():  # released ones are placeholders
        if p.numel():
            assert p.dtype == torch.bfloat16 and p.device == torch.device(device), name
            assert torch.equal(p.detach().cpu(), full[name].to(torch.bfloat16)), name
    engine.close()
    for name, p in model.named_parameters():  # the fp32 model back, with its masters
        assert p.dtype == torch.float32 and p.device == torch.device(device), name
        assert torch.equal(p.detach().cpu(), full[name]), name


def fp16_overflow_skips(device, stage):
    """An inf in one gradient skips the update on every parameter and halves
    the loss scale; the next clean step updates again."""
    model, _ = pair(device)
    engine = zero.initialize(model, optimizer=make_optimizer("adamw", model.parameters()),
                             stage=stage, precision="fp16", stage3_param_persistence_threshold=0,
                             loss_scaling=zero.LossScaling(hysteresis=1))
    tokens, targets = batches(device, 1)[0]
    before = engine.full_state_dict()
    scale = engine.loss_scale
    poison = model.head.bias.register_hook(lambda g: torch.full_like(g, float("inf")))
    engine.backward(loss_of(engine(tokens), targets))
    engine.step()
    poison.remove()
    assert engine.step_was_skipped and engine.loss_scale == scale / 2
    for name, value in engine.full_state_dict().items():
        assert torch.equal(value, before[name]), name
    engine.backward(loss_of(engine(tokens), targets))
    engine.step()
    assert not engine.step_was_skipped
    after = engine.full_state_dict()
    assert not torch.equal(after["head.weight"], before["head.weight"])
    assert all(torch.isfinite(v).all() for v in after.values())
    engine.close()


def finish(engine):
    """(full fp32 state dict, optimizer states by (group, name)) of an
    engine, which is then closed: what two runs are compared on."""
    state = engine.full_state_dict()
    states = {(fg.index, k): v.clone() for fg in engine.groups for k, v in fg.states.items()}
    engine.close()
    return state, states


def assert_same_finish(got, expected):
    """Two finish() results equal bit for bit."""
    for ours, ref in zip(got, expected, strict=True):
        assert ours.keys() == ref.keys()
        for key in ref:
            assert torch.equal(ours[key], ref[key]), key


def assert_checkpoint_chain_exact(directory, first, middle, last):
    """first() trains and saves; middle() loads that and saves; last()
    loads middle's and saves (each a factory of an engine, built only when
    the one before is closed). The first and the last checkpoint hold the
    same weights and optimizer states, compared consolidated, in
    parameter space."""
    previous = None
    for tag, make in (("a", first), ("b", middle), ("c", last)):
        engine = make()
        if previous is not None:
            engine.load_checkpoint(directory / previous)
        engine.save_checkpoint(directory / tag)
        engine.close()
        previous = tag
    saved, again = (zero.checkpoint.consolidate(directory / tag) for tag in ("a", "c"))
    for key, value in saved["model"].items():
        assert torch.equal(again["model"][key], value), key
    for index, entry in saved["optimizer"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(again["optimizer"]["state"][index][name], value), name


def mapped_rss(tensor):
    """Resident bytes of the memory mapping that holds `tensor` (an
    offload file's), from /proc/self/smaps."""
    address, rss, inside = tensor.data_ptr(), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                rss += int(line.split()[1]) * 1024
    return rss


# The start of a script that measures resident memory in a fresh process:
# status(field) reads /proc/self/status in bytes; `base` is VmRSS once the
# imports are done and an input x exists, before any model.
PEAK_PRELUDE = """
import gc, sys, torch, zero
torch.set_num_threads(1)
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
x = torch.randn(8, 1024)
gc.collect()
base = status("VmRSS")
"""


def run_peak_script(body, *args):
    """Run PEAK_PRELUDE + body in a fresh interpreter with `args` as argv;
    returns the integers it prints. Allocations over 64 KiB are mmapped,
    so freed memory leaves the process at once."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run([sys.executable, "-c", PEAK_PRELUDE + textwrap.dedent(body),
                           *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return [int(word) for word in done.stdout.split()]

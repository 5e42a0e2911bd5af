"""A training script written for DeepSpeed (0.19.8), with DeepSpeed's API
only: add_config_arguments, init_distributed, zero.Init, initialize with
model_parameters and training_data (its dataloader), backward/step,
GatheredParameters, save_checkpoint/load_checkpoint and zero_to_fp32,
accelerator. tests/test_deepspeed_api.py runs it on zero with the import
line below changed to `import zero.deepspeed as deepspeed`, and compares
with the losses DeepSpeed itself gave, stored in
tests/data/deepspeed_losses.json (made with `python tests/deepspeed_script.py
--make-reference [RUN ...]`, where DeepSpeed is installed: not a test
dependency).

Usage (one rank: python; several: torchrun):
    python tests/deepspeed_script.py --stage 2 --out result.json --save ckpt/
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from torch import nn

import deepspeed  # the line a user changes: import zero.deepspeed as deepspeed

STEPS = 6
AFTER_RESUME = 2  # steps after the save and load: they read the optimizer's states


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x))


class Data(torch.utils.data.Dataset):
    """64 fixed random regression samples."""

    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(64, 16, generator=g)
        self.y = torch.randn(64, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def config(stage, bf16=False):
    return {"bf16": {"enabled": bf16}, "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3,
                                                         "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 10}},
            "zero_optimization": {"stage": stage}}


def step(engine, batches, device, bf16):
    x, y = next(batches)
    x = x.to(device)
    out = engine(x.bfloat16()).float() if bf16 else engine(x)
    loss = nn.functional.mse_loss(out, y.to(device))
    engine.backward(loss)
    engine.step()
    return loss.item()


def train(args):
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    ds_config = config(args.stage, args.bf16)
    with deepspeed.zero.Init(enabled=args.stage == 3, config_dict_or_path=ds_config):
        model = Net()
    if args.frozen:  # a frozen parameter: DeepSpeed keeps it apart in its checkpoints
        model.body[0].bias.requires_grad_(False)
    engine, _optimizer, loader, _scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=[p for p in model.parameters()
                                                  if p.requires_grad],
        training_data=Data(), config=ds_config)
    device = deepspeed.accelerator.get_accelerator().device_name()
    batches = iter(loader)
    rank = int(os.environ.get("RANK", 0))
    if args.resume:  # a converted checkpoint: the batches after the saved steps
        for _ in range(STEPS):
            next(batches)
        engine.load_checkpoint(args.resume)
        losses = [step(engine, batches, device, args.bf16) for _ in range(AFTER_RESUME)]
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"losses": losses, "global_steps": engine.global_steps}, f)
        return
    losses = [step(engine, batches, device, args.bf16) for _ in range(STEPS)]
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        norm = float(sum(p.detach().float().square().sum() for p in engine.module.parameters()))
    engine.save_checkpoint(args.save)
    engine.load_checkpoint(args.save)  # resumes where it was
    steps = engine.global_steps
    losses += [step(engine, batches, device, args.bf16) for _ in range(AFTER_RESUME)]
    if rank == 0:
        state_norm = None
        if args.stage > 0:  # DeepSpeed's zero_to_fp32 reads ZeRO checkpoints only
            state = deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                args.save)
            state_norm = float(sum(v.detach().float().square().sum() for v in state.values()))
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "global_steps": steps, "weight_norm_squared": norm,
                       "state_norm_squared": state_norm}, f)


# DeepSpeed's checkpoints kept for tests/test_from_deepspeed.py (world, stage, variant:
# "" fp32, "bf16", or "frozen": fp32 with body.0.bias frozen)
KEPT_CHECKPOINTS = [(1, 0, ""), (2, 0, ""), (1, 2, ""), (2, 1, ""), (2, 2, ""), (2, 3, ""),
                    (2, 1, "bf16"), (2, 3, "bf16"), (2, 2, "frozen"), (2, 3, "frozen")]


def run_name(world, stage, variant):
    return f"{variant + '-' if variant else ''}world{world}-stage{stage}"


def make_reference(data, only=()):
    """DeepSpeed's figures for every stage on 1 and 2 ranks (torchrun, as
    DeepSpeed builds its DistributedSampler only under a launcher), and
    some of its checkpoints (without the scripts DeepSpeed copies beside
    them), for the converter's tests. `only`: these runs' names, merged
    into the stored figures."""
    path = os.path.join(data, "deepspeed_losses.json")
    results = {}
    if only:
        with open(path) as f:
            results = json.load(f)
    runs = [(world, stage, "") for world in (1, 2) for stage in (0, 1, 2, 3)]
    runs += [run for run in KEPT_CHECKPOINTS if run[2]]
    for world, stage, variant in runs:
        name = run_name(world, stage, variant)
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as scratch:
            out, ckpt = os.path.join(scratch, "out.json"), os.path.join(scratch, "ckpt")
            subprocess.run([sys.executable, "-m", "torch.distributed.run",
                            f"--nproc_per_node={world}", "--master_port=29561",
                            __file__, "--stage", str(stage), "--out", out, "--save", ckpt,
                            *([f"--{variant}"] if variant else [])],
                           check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
            with open(out) as f:
                results[name] = json.load(f)
            if (world, stage, variant) in KEPT_CHECKPOINTS:
                kept = os.path.join(data, "deepspeed_checkpoints", name)
                shutil.rmtree(kept, ignore_errors=True)
                shutil.copytree(ckpt, kept, ignore=shutil.ignore_patterns("*.py"))
    results["made_with"] = f"deepspeed {deepspeed.__version__}, torch {torch.__version__}"
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--save")
    parser.add_argument("--resume", help="load this (converted) checkpoint after the saved "
                        "steps' batches and train the steps after the resume")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--frozen", action="store_true", help="freeze body.0.bias")
    parser.add_argument("--make-reference", nargs="*", metavar="RUN",
                        help="run DeepSpeed (all runs, or these names) and store its figures")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.make_reference is not None:
        make_reference(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"),
                       args.make_reference)
    else:
        train(args)


if __name__ == "__main__":
    main()

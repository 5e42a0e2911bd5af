"""A training script written for DeepSpeed (0.19.8), with DeepSpeed's API
only: add_config_arguments, init_distributed, zero.Init, initialize with
model_parameters and training_data (its dataloader), backward/step,
GatheredParameters, save_checkpoint/load_checkpoint and zero_to_fp32,
accelerator. tests/test_deepspeed_api.py runs it on zero with the import
line below changed to `import zero.deepspeed as deepspeed`, and compares
with the losses DeepSpeed itself gave, stored in
tests/data/deepspeed_losses.json (made with `python tests/deepspeed_script.py
--make-reference`, where DeepSpeed is installed: not a test dependency).

Usage (one rank: python; several: torchrun):
    python tests/deepspeed_script.py --stage 2 --out result.json --save ckpt/
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from torch import nn

import deepspeed  # the line a user changes: import zero.deepspeed as deepspeed

STEPS = 6


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


def config(stage):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}}


def train(args):
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    ds_config = config(args.stage)
    with deepspeed.zero.Init(enabled=args.stage == 3, config_dict_or_path=ds_config):
        model = Net()
    engine, _optimizer, loader, _scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=Data(),
        config=ds_config)
    device = deepspeed.accelerator.get_accelerator().device_name()
    batches = iter(loader)
    losses = []
    for _ in range(STEPS):
        x, y = next(batches)
        loss = nn.functional.mse_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        norm = float(sum(p.detach().float().square().sum() for p in engine.module.parameters()))
    engine.save_checkpoint(args.save)
    engine.load_checkpoint(args.save)  # resumes where it was
    steps = engine.global_steps
    x, y = next(batches)
    loss = nn.functional.mse_loss(engine(x.to(device)), y.to(device))
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        state_norm = None
        if args.stage > 0:  # DeepSpeed's zero_to_fp32 reads ZeRO checkpoints only
            state = deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                args.save)
            state_norm = float(sum(v.float().square().sum() for v in state.values()))
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "global_steps": steps, "weight_norm_squared": norm,
                       "state_norm_squared": state_norm}, f)


def make_reference(path):
    """DeepSpeed's figures for every stage on 1 and 2 ranks (torchrun, as
    DeepSpeed builds its DistributedSampler only under a launcher)."""
    results = {}
    for world in (1, 2):
        for stage in (0, 1, 2, 3):
            with tempfile.TemporaryDirectory() as scratch:
                out = os.path.join(scratch, "out.json")
                subprocess.run([sys.executable, "-m", "torch.distributed.run",
                                f"--nproc_per_node={world}", "--master_port=29561",
                                __file__, "--stage", str(stage), "--out", out,
                                "--save", os.path.join(scratch, "ckpt")],
                               check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
                with open(out) as f:
                    results[f"world{world}-stage{stage}"] = json.load(f)
    results["made_with"] = f"deepspeed {deepspeed.__version__}, torch {torch.__version__}"
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--save")
    parser.add_argument("--make-reference", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.make_reference:
        make_reference(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                                    "deepspeed_losses.json"))
    else:
        train(args)


if __name__ == "__main__":
    main()

"""LR schedules named in DeepSpeed configs (WarmupLR, WarmupDecayLR), built
as torch LambdaLR schedulers on the user's optimizer."""
from __future__ import annotations

import math

import torch


def _warmup_factor(step, warmup_steps, warmup_type):
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    if warmup_type == "linear":
        return step / warmup_steps
    return math.log(step + 1) / math.log(warmup_steps)  # DeepSpeed's default "log"


def scheduler_from_config(spec: dict, optimizer):
    kind = spec.get("type")
    params = dict(spec.get("params", {}))
    known = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
             "total_num_steps", "last_batch_iteration"}
    unknown = set(params) - known
    if unknown:
        raise ValueError(f"unknown scheduler.params key(s): {', '.join(sorted(unknown))}")
    lo = float(params.get("warmup_min_lr", 0.0))
    hi = float(params.get("warmup_max_lr", 0.001))
    warm = int(params.get("warmup_num_steps", 1000))
    wtype = params.get("warmup_type", "log")
    if kind == "WarmupLR":
        def lr_at(step):
            return lo + (hi - lo) * _warmup_factor(step, warm, wtype)
    elif kind == "WarmupDecayLR":
        total = int(params["total_num_steps"])

        def lr_at(step):
            if step < warm:
                return lo + (hi - lo) * _warmup_factor(step, warm, wtype)
            return hi * max(0.0, (total - step) / max(1, total - warm))
    else:
        raise ValueError(f"scheduler.type {kind!r} is not supported; choose WarmupLR or "
                         "WarmupDecayLR, or pass lr_scheduler=")
    for group in optimizer.param_groups:
        group["lr"] = hi  # LambdaLR multiplies the initial lr
        group["initial_lr"] = hi
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s) / hi if hi else 0.0)

"""LR schedules named in DeepSpeed configs (WarmupLR, WarmupDecayLR,
WarmupCosineLR here; OneCycle and LRRangeTest in _cyclic_schedules.py), as
torch schedulers on the user's optimizer, with DeepSpeed's numbers: a
config moved from DeepSpeed must give the same learning rate at every
update.

DeepSpeed's schedule, per its documentation and measured against
deepspeed 0.19.8: the optimizer starts at warmup_min_lr; the engine steps
the scheduler after each update, and the i-th scheduler step (i = 0, 1, ...)
sets lr = min + (max - min) * gamma(i), where during warm-up (i < W)
gamma = log(i + 1) / log(W) ("log", the default) or i / W ("linear"), after
it 1 (WarmupLR) or max(0, (T - i) / max(1, T - W)) (WarmupDecayLR, ending at
min at step T). gamma(0) = 0, so the first two updates both use min. W is
warmup_num_steps raised to at least 2, as DeepSpeed does. Every param group
gets the same learning rate, except where WarmupLR has no warmup_max_lr:
then each group warms up to its own lr at construction, as DeepSpeed's
WarmupLR does (WarmupDecayLR's default max is 0.001).
"""
from __future__ import annotations

import math

from torch.optim.lr_scheduler import LRScheduler

from zero.config._cyclic_schedules import (DeepSpeedOneCycle, DeepSpeedRangeTest,
                                           DeepSpeedStateDict, per_group)
from zero.config._values import auto_refused

SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
_WARMUP_KEYS = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                "total_num_steps", "last_batch_iteration"}
_KNOWN = {  # each type's params: DeepSpeed's constructor arguments
    # DeepSpeed's WarmupLR takes no total_num_steps (a TypeError there)
    "WarmupLR": _WARMUP_KEYS - {"total_num_steps"}, "WarmupDecayLR": _WARMUP_KEYS,
    "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps",
                       "cos_min_ratio", "warmup_type", "last_batch_iteration"},
    "OneCycle": {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
                 "cycle_second_step_size", "cycle_first_stair_count",
                 "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                 "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"},
    "LRRangeTest": {"lr_range_test_min_lr", "lr_range_test_step_size",
                    "lr_range_test_step_rate", "lr_range_test_staircase",
                    "last_batch_iteration"},
}


class _DeepSpeedSchedule(DeepSpeedStateDict, LRScheduler):
    """What DeepSpeed's warm-up schedules share. torch's step count k (0 at
    construction) is DeepSpeed's last_batch_iteration + 1."""

    def __init__(self, optimizer, warmup_steps, warmup_type, last_batch_iteration):
        self.warmup_steps = max(2, warmup_steps)
        self.warmup_type = warmup_type
        if last_batch_iteration != -1:  # resumed: torch wants each group's initial_lr
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    def _warmup_gamma(self, i: int) -> float:
        """0 -> 1 over the warm-up's iterations i < W."""
        if self.warmup_type == "linear":
            return i / self.warmup_steps
        return math.log(i + 1) / math.log(self.warmup_steps)


class DeepSpeedWarmup(_DeepSpeedSchedule):
    """WarmupLR (total_steps None) or WarmupDecayLR."""

    def __init__(self, optimizer, min_lr, max_lr, warmup_steps, warmup_type, total_steps=None,
                 last_batch_iteration=-1):
        # max_lr None: each group's own lr (WarmupLR without warmup_max_lr):
        # the one it had before any schedule moved it ("initial_lr", which
        # torch's schedulers keep in the group), so a schedule built again
        # on the same optimizer (a new initialize after close()) does not
        # take a warmed-up rate for the peak ([Note: counts carried across
        # close])
        self.min_lr = min_lr
        self.max_lrs = [group.get("initial_lr", group["lr"]) if max_lr is None else max_lr
                        for group in optimizer.param_groups]
        self.total_steps = total_steps
        super().__init__(optimizer, warmup_steps, warmup_type, last_batch_iteration)

    def lrs_at(self, k: int) -> list:
        """Each group's learning rate after torch's k-th step."""
        i = k - 1  # DeepSpeed's iteration; -1: before its first step
        if i < 0:
            return [self.min_lr for _ in self.max_lrs]
        gamma = self._gamma(i)
        return [self.min_lr + (max_lr - self.min_lr) * gamma for max_lr in self.max_lrs]

    def _gamma(self, i: int) -> float:
        if i < self.warmup_steps:
            return self._warmup_gamma(i)
        if self.total_steps is None:
            return 1.0
        return max(0.0, (self.total_steps - i) / max(1, self.total_steps - self.warmup_steps))

    def get_lr(self):
        return self.lrs_at(self.last_epoch)


class DeepSpeedWarmupCosine(_DeepSpeedSchedule):
    """WarmupCosineLR: each group's own lr times a ratio. DeepSpeed's
    numbers: before its first step (at construction) the ratio is 0; its
    i-th step sets min_ratio + (1 - min_ratio) * gamma(i) during warm-up
    (gamma as WarmupLR's), then cos_min + (1 - cos_min) * (1 + cos(pi p)) / 2
    with p = min(1, (i - W + 1) / max(1, T - W)), so it ends at cos_min."""

    def __init__(self, optimizer, total_steps, min_ratio, warmup_steps, cos_min_ratio,
                 warmup_type, last_batch_iteration=-1):
        self.total_steps, self.min_ratio = total_steps, min_ratio
        self.cos_min_ratio = cos_min_ratio
        super().__init__(optimizer, warmup_steps, warmup_type, last_batch_iteration)

    def ratio_at(self, k: int) -> float:
        i = k - 1  # DeepSpeed's iteration; -1: before its first step
        if i < 0:
            return 0.0
        w = self.warmup_steps
        if i < w:
            return self.min_ratio + (1.0 - self.min_ratio) * self._warmup_gamma(i)
        progress = min(1.0, (i - w + 1) / max(1, self.total_steps - w))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self):
        ratio = self.ratio_at(self.last_epoch)
        return [base * ratio for base in self.base_lrs]


def _number(params, key, default, kind=float, low=None):
    value = params.get(key, default)
    if value == "auto":
        raise auto_refused(f"scheduler.params.{key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or (kind is int and value != int(value)) or \
            (low is not None and value < low):
        rule = "an integer" if kind is int else "a finite number"
        rule += f" >= {low}" if low is not None else ""
        raise ValueError(f"scheduler.params.{key} must be {rule}, got {value!r}")
    return kind(value)


def _numbers(params, key, default, optimizer, low=None) -> list:
    """A number, or a list of one per param group (as DeepSpeed takes)."""
    values = per_group(optimizer, params.get(key, default), key)
    return [_number({key: v}, key, None, low=low) for v in values]


def _flag(params, key, default) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"scheduler.params.{key} must be true or false, got {value!r}")
    return value


def _required(params, key, kind):
    if key not in params:
        raise ValueError(f"scheduler.params.{key} is required by {kind}")


def _one_cycle(params, optimizer):
    for key in ("cycle_min_lr", "cycle_max_lr"):
        _required(params, key, "OneCycle")
    first = _number(params, "cycle_first_step_size", 2000, low=0.0)
    if first == 0:
        raise ValueError("scheduler.params.cycle_first_step_size must be > 0, got 0")
    second = params.get("cycle_second_step_size")
    second = first if second is None else _number(params, "cycle_second_step_size", None,
                                                   low=0.0)
    first_stairs = _number(params, "cycle_first_stair_count", 0, int, low=0)
    second_stairs = params.get("cycle_second_stair_count")
    second_stairs = first_stairs if second_stairs is None else \
        _number(params, "cycle_second_stair_count", None, int, low=0)
    return DeepSpeedOneCycle(
        optimizer, _numbers(params, "cycle_min_lr", None, optimizer, low=0.0),
        _numbers(params, "cycle_max_lr", None, optimizer, low=0.0), first, second,
        first_stairs, second_stairs, _number(params, "decay_step_size", 0, low=0.0),
        _number(params, "decay_lr_rate", 0.0), _flag(params, "cycle_momentum", True),
        _numbers(params, "cycle_min_mom", 0.8, optimizer, low=0.0),
        _numbers(params, "cycle_max_mom", 0.9, optimizer, low=0.0),
        _number(params, "decay_mom_rate", 0.0),
        _number(params, "last_batch_iteration", -1, int, low=-1))


def _range_test(params, optimizer):
    return DeepSpeedRangeTest(
        optimizer, _numbers(params, "lr_range_test_min_lr", 1e-3, optimizer, low=0.0),
        _number(params, "lr_range_test_step_size", 2000, int, low=1),
        _number(params, "lr_range_test_step_rate", 1.0),
        _flag(params, "lr_range_test_staircase", False),
        _number(params, "last_batch_iteration", -1, int, low=-1))


def _warmup_cosine(params, optimizer, warmup_type):
    _required(params, "total_num_steps", "WarmupCosineLR (the step at which the cosine "
                                         "reaches cos_min_ratio)")
    return DeepSpeedWarmupCosine(
        optimizer, _number(params, "total_num_steps", None, int, low=1),
        _number(params, "warmup_min_ratio", 0.0, low=0.0),
        _number(params, "warmup_num_steps", 1000, int, low=1),
        _number(params, "cos_min_ratio", 0.0001, low=0.0), warmup_type,
        _number(params, "last_batch_iteration", -1, int, low=-1))


def _warmup(kind, params, optimizer, warmup_type):
    total = None
    if kind == "WarmupDecayLR":
        _required(params, "total_num_steps", "WarmupDecayLR (the step at which the learning "
                                             "rate is back at warmup_min_lr)")
        total = _number(params, "total_num_steps", None, int, low=1)
    # DeepSpeed's WarmupLR warms each group up to its own lr when no
    # warmup_max_lr is given (None here); WarmupDecayLR's default is 0.001
    max_lr = None if kind == "WarmupLR" and "warmup_max_lr" not in params else \
        _number(params, "warmup_max_lr", 0.001, low=0.0)
    return DeepSpeedWarmup(
        optimizer, _number(params, "warmup_min_lr", 0.0, low=0.0), max_lr,
        _number(params, "warmup_num_steps", 1000, int, low=1), warmup_type, total,
        _number(params, "last_batch_iteration", -1, int, low=-1))


def scheduler_from_config(spec: dict, optimizer):
    if not isinstance(spec, dict) or not isinstance(spec.get("params", {}), dict):
        raise ValueError(f"scheduler must be a block such as {{\"type\": \"WarmupLR\", "
                         f"\"params\": {{...}}}}, got {spec!r}")
    unknown = sorted(set(spec) - {"type", "params"})
    if unknown:  # "param": the schedule's defaults, silently
        hint = " (a typo of 'scheduler.params'?)" if "param" in unknown else ""
        raise ValueError(f"scheduler.{unknown[0]}: not a key of the scheduler block, which "
                         f"holds type and params{hint}")
    kind = spec.get("type")
    if kind not in SCHEDULER_TYPES:
        raise ValueError(f"scheduler.type {kind!r} is not supported; choose "
                         f"{', '.join(SCHEDULER_TYPES)}, or pass lr_scheduler=")
    params = dict(spec.get("params", {}))
    unknown = set(params) - _KNOWN[kind]
    if unknown:
        hint = " (WarmupLR holds the peak for good; WarmupDecayLR decays to " \
            "total_num_steps)" if kind == "WarmupLR" and "total_num_steps" in unknown else ""
        raise ValueError(f"unknown scheduler.params key(s) for {kind}: "
                         f"{', '.join(sorted(unknown))}{hint}")
    if kind == "OneCycle":
        return _one_cycle(params, optimizer)
    if kind == "LRRangeTest":
        return _range_test(params, optimizer)
    warmup_type = params.get("warmup_type", "log")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"scheduler.params.warmup_type must be 'log' or 'linear', got "
                         f"{warmup_type!r}")
    if kind == "WarmupCosineLR":
        return _warmup_cosine(params, optimizer, warmup_type)
    return _warmup(kind, params, optimizer, warmup_type)

"""DeepSpeed's cyclic LR schedules (OneCycle, LRRangeTest) as torch
schedulers, with DeepSpeed's numbers (measured against deepspeed 0.19.8;
tests/test_deepspeed_config.py holds its printed values).

As in _schedulers.py, torch's step count k (0 at construction) is
DeepSpeed's last_batch_iteration + 1, and the engine steps the scheduler
once after each applied update. Both schedules are functions of k:

- LRRangeTest: lr = min_lr * (1 + rate * k / step_size), or with
  `lr_range_test_staircase` the floor of k / step_size.
- OneCycle: a cycle of T = first + second iterations. While
  last_batch_iteration < T, lr = min + (max - min) * s(k), where s climbs
  0 -> 1 over the first half and falls back over the second (in
  `stair_count` flat steps when one is set); the momentum (beta1) moves the
  other way, max_mom - (max_mom - min_mom) * s(k). After the cycle, with
  decay on, lr = min / (1 + decay_lr_rate * d / decay_step_size) and
  beta1 = max_mom * (1 + decay_mom_rate * d / decay_step_size), where
  d = k - T; with decay off they stay at min_lr and max_mom.

DeepSpeed's quirks are kept, so a config gives the same update as there:
while momentum cycles, beta2 is set to 0.99 whatever the optimizer had;
the first update uses (min_mom, 0.99), not the curve's value at k = 0; an
optimizer without betas (SGD) does not cycle momentum (a warning says so).
One difference: a schedule resumed with `last_batch_iteration` L sets the
lr (and betas) of iteration L at once, where DeepSpeed leaves the
optimizer's values for the first update after the resume.
"""
from __future__ import annotations

import math

from torch.optim.lr_scheduler import LRScheduler

from zero._warnings import warn_user

BETA2_WHILE_CYCLING = 0.99  # DeepSpeed's OneCycle sets it


def per_group(optimizer, value, name: str) -> list:
    """One value for every param group, or a list with one per group."""
    count = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"scheduler.params.{name} has {len(value)} values but the "
                             f"optimizer has {count} param groups")
        return list(value)
    return [value] * count


def _resumed(optimizer, last_batch_iteration: int) -> None:
    if last_batch_iteration != -1:  # torch wants each group's initial_lr
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])


class DeepSpeedStateDict:
    """[Note: a schedule resumes where it stopped, on its new curve]
    load_state_dict takes the position only, as DeepSpeed's schedules do
    (their state is last_batch_iteration alone): the curve stays the one
    this schedule was built with, from the config of the run that resumes.
    A job that raises total_num_steps or warmup_max_lr and resumes gets the
    new curve from the step it stopped at; taking the whole saved state
    kept the old one, with no word. Both forms load: torch's (what
    state_dict returns, last_epoch) and DeepSpeed's own
    {"last_batch_iteration": i} (a checkpoint converted from DeepSpeed by
    zero.checkpoint.convert_deepspeed): after i + 1 DeepSpeed steps torch's
    schedule is at last_epoch i + 1, having been stepped i + 2 times (once
    at construction)."""

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's position: the iteration its schedule last set (-1
        before the first step), torch's last_epoch - 1."""
        return self.last_epoch - 1

    @last_batch_iteration.setter
    def last_batch_iteration(self, value):
        self.last_epoch = int(value) + 1

    def step(self, last_batch_iteration=None):
        """torch's step(), or DeepSpeed's step(last_batch_iteration=i): the
        learning rates of iteration i at once (torch's deprecated
        step(epoch) would read i as last_epoch, one iteration behind)."""
        if last_batch_iteration is None:
            return super().step()
        self.last_batch_iteration = last_batch_iteration
        self._step_count += 1
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        return None

    def load_state_dict(self, state_dict):
        if set(state_dict) == {"last_batch_iteration"}:
            i = int(state_dict["last_batch_iteration"])
            last_epoch, step_count = i + 1, i + 2
        elif "last_epoch" in state_dict:
            last_epoch = int(state_dict["last_epoch"])
            step_count = int(state_dict.get("_step_count", last_epoch + 1))
        else:
            return super().load_state_dict(state_dict)
        self.last_epoch, self._step_count = last_epoch, step_count
        self._last_lr = list(self.get_lr())
        return None


class DeepSpeedRangeTest(DeepSpeedStateDict, LRScheduler):
    """LRRangeTest: each group's lr grows linearly (or in stairs) from its
    min_lr, by `rate` times min_lr every `step_size` updates."""

    def __init__(self, optimizer, min_lrs: list, step_size: int, rate: float,
                 staircase: bool, last_batch_iteration: int = -1):
        self.min_lrs, self.step_size = min_lrs, step_size
        self.rate, self.staircase = rate, staircase
        _resumed(optimizer, last_batch_iteration)
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    def get_lr(self):
        interval = self.last_epoch / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.rate * interval) for low in self.min_lrs]


class DeepSpeedOneCycle(DeepSpeedStateDict, LRScheduler):
    """OneCycle: one cycle of lr up and down (and beta1 down and up), then
    an optional slow decay. See the module docstring for the curve."""

    def __init__(self, optimizer, min_lrs: list, max_lrs: list, first_size: float,
                 second_size: float, first_stairs: int, second_stairs: int,
                 decay_step_size: float, decay_lr_rate: float, cycle_momentum: bool,
                 min_moms: list, max_moms: list, decay_mom_rate: float,
                 last_batch_iteration: int = -1):
        self.min_lrs, self.max_lrs = min_lrs, max_lrs
        self.first_size, self.second_size = first_size, second_size
        self.total_size = first_size + second_size
        self.up_share = first_size / self.total_size  # the rising half's share of a cycle
        self.first_stairs, self.second_stairs = first_stairs, second_stairs
        self.decay_step_size = decay_step_size
        self.decay_lr_rate, self.decay_mom_rate = decay_lr_rate, decay_mom_rate
        self.min_moms, self.max_moms = min_moms, max_moms
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            warn_user(f"OneCycle: cycle_momentum is off because "
                      f"{type(optimizer).__name__} has no betas (as in DeepSpeed)")
        _resumed(optimizer, last_batch_iteration)
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    def _scale(self, k: int) -> float:
        """0 -> 1 over the cycle's rising part, 1 -> 0 over its falling part."""
        cycle = math.floor(1 + k / self.total_size)
        x = 1.0 + k / self.total_size - cycle  # position in the cycle, 0..1
        if x <= self.up_share:
            scale, stairs = x / self.up_share, self.first_stairs
        else:
            scale, stairs = (x - 1) / (self.up_share - 1), self.second_stairs
        if stairs > 0:
            # from the whole iteration count, not the rounded scale: a
            # scale just under 1.0 would drop a whole stair off the peak
            into_cycle = k % self.total_size
            if into_cycle <= self.first_size:
                position = into_cycle * stairs / self.first_size
            else:
                position = (self.total_size - into_cycle) * stairs / self.second_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_intervals(self) -> float:
        return (self.last_epoch - self.total_size) / self.decay_step_size

    def _in_cycle(self) -> bool:
        return self.last_epoch - 1 < self.total_size  # DeepSpeed's last_batch_iteration

    def get_lr(self):
        if self._in_cycle():
            scale = self._scale(self.last_epoch)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_intervals()
        return [low / factor for low in self.min_lrs]

    def _beta1s(self) -> list:
        if self.last_epoch == 0:  # DeepSpeed starts at min_mom
            return list(self.min_moms)
        if self._in_cycle():
            scale = self._scale(self.last_epoch)
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_intervals()
        return [high * factor for high in self.max_moms]

    def step(self, *args, **kwargs):
        super().step(*args, **kwargs)
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self._beta1s()):
                group["betas"] = (beta1, BETA2_WHILE_CYCLING)

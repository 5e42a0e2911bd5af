"""deepspeed.runtime.lr_schedules: DeepSpeed's schedules built by hand
(`WarmupLR(optimizer, warmup_num_steps=100)`) as scripts and Lightning
modules build them, then passed to deepspeed.initialize(lr_scheduler=...).
Each returns the schedule a config's "scheduler" block builds
(config/_schedulers.py), so both ways give DeepSpeed's learning rate at
every update; the arguments are DeepSpeed's, with its defaults, and an
argument left out takes the config reader's default (the same)."""
from __future__ import annotations

from zero.config._schedulers import scheduler_from_config

_LEFT_OUT = object()


def _built(kind, arguments: dict):
    """The schedule of `kind` from a factory's arguments (its locals())."""
    params = {key: value for key, value in arguments.items()
              if key != "optimizer" and value is not _LEFT_OUT}
    return scheduler_from_config({"type": kind, "params": params}, arguments["optimizer"])


def WarmupLR(optimizer, warmup_min_lr=_LEFT_OUT, warmup_max_lr=_LEFT_OUT,  # noqa: N802
             warmup_num_steps=_LEFT_OUT, warmup_type=_LEFT_OUT, last_batch_iteration=_LEFT_OUT):
    """From warmup_min_lr (0) up to warmup_max_lr (each group's own lr when
    left out) over warmup_num_steps (1000), "log" or "linear", then held."""
    return _built("WarmupLR", locals())


def WarmupDecayLR(optimizer, total_num_steps, warmup_min_lr=_LEFT_OUT,  # noqa: N802
                  warmup_max_lr=_LEFT_OUT, warmup_num_steps=_LEFT_OUT, warmup_type=_LEFT_OUT,
                  last_batch_iteration=_LEFT_OUT):
    """WarmupLR's warm-up (to 0.001 when warmup_max_lr is left out), then a
    linear decay back to warmup_min_lr at total_num_steps."""
    return _built("WarmupDecayLR", locals())


def WarmupCosineLR(optimizer, total_num_steps, warmup_min_ratio=_LEFT_OUT,  # noqa: N802
                   warmup_num_steps=_LEFT_OUT, cos_min_ratio=_LEFT_OUT, warmup_type=_LEFT_OUT,
                   last_batch_iteration=_LEFT_OUT):
    """Each group's lr times a ratio: warmed up from warmup_min_ratio, then
    a cosine down to cos_min_ratio at total_num_steps."""
    return _built("WarmupCosineLR", locals())


def OneCycle(optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=_LEFT_OUT,  # noqa: N802
             cycle_first_step_size=_LEFT_OUT, cycle_second_step_size=_LEFT_OUT,
             cycle_first_stair_count=_LEFT_OUT, cycle_second_stair_count=_LEFT_OUT,
             decay_step_size=_LEFT_OUT, cycle_momentum=_LEFT_OUT, cycle_min_mom=_LEFT_OUT,
             cycle_max_mom=_LEFT_OUT, decay_mom_rate=_LEFT_OUT,
             last_batch_iteration=_LEFT_OUT):
    """One cycle of the lr up and down (beta1 down and up), then an
    optional decay."""
    return _built("OneCycle", locals())


def LRRangeTest(optimizer, lr_range_test_min_lr=_LEFT_OUT,  # noqa: N802
                lr_range_test_step_size=_LEFT_OUT, lr_range_test_step_rate=_LEFT_OUT,
                lr_range_test_staircase=_LEFT_OUT, last_batch_iteration=_LEFT_OUT):
    """The lr grows from lr_range_test_min_lr by step_rate times it every
    step_size updates (in stairs with staircase)."""
    return _built("LRRangeTest", locals())


__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]

"""zero.settings_that_fit: which stage and offload settings hold a model's
states within a machine's GPU memory, host memory and disk, fastest first.

Each row is zero.estimate_memory's figures for one setting, with the two
figures only a run knows filled in by rule (see _run_bytes), summed per
place. What is not model state (activations, the CUDA context, the
allocator's slack, other processes) is not counted: leave room for it
with `headroom`.
"""
from __future__ import annotations

import torch

from zero.engine._engine import DTYPES
from zero.engine._estimate import estimate_memory, unit_totals
from zero.engine._arguments import resolve_config
from zero.sharding._buckets import MAX_IN_FLIGHT

# the settings tried, in the order they cost speed: more offloaded means
# more traffic over the host link or the disk each step
_OFFLOADS = [
    ("none", "none", (0, 1, 2, 3)),
    ("cpu", "none", (1, 2, 3)),
    ("nvme", "none", (1, 2, 3)),
    ("cpu", "cpu", (3,)),
    ("nvme", "cpu", (3,)),
    ("nvme", "nvme", (3,)),
]
_PLACEHOLDER_PATH = "nvme_path"  # a size does not need the directory


class FitTable(list):
    """Rows of {stage, offload_optimizer, offload_param, device, host,
    disk, fits}; str() is a table. `best` is the first row that fits."""

    @property
    def best(self):
        return next((row for row in self if row["fits"]), None)

    def __str__(self):
        lines = [f"{'stage':<6}{'offload_optimizer':<19}{'offload_param':<15}"
                 f"{'device GiB':>11}{'host GiB':>10}{'disk GiB':>10}  fits"]
        for row in self:
            lines.append(f"{row['stage']:<6}{row['offload_optimizer']:<19}"
                         f"{row['offload_param']:<15}{row['device'] / 2**30:>11.2f}"
                         f"{row['host'] / 2**30:>10.2f}{row['disk'] / 2**30:>10.2f}  "
                         f"{'yes' if row['fits'] else 'no'}")
        return "\n".join(lines)


def settings_that_fit(model, world_size: int = 1, *, device_memory, host_memory, disk=0,
                      device="cuda", headroom: float = 0.1, local_ranks: int | None = None,
                      **options) -> FitTable:
    """Every stage and offload setting for training `model` on world_size
    ranks, with the bytes one rank's model states take on its device, in
    host memory and on disk, and whether they fit: the device's within
    device_memory, the host's of the local_ranks ranks sharing a machine
    (default: all of them, up to 8) within host_memory, their files within
    disk, each less `headroom` (a fraction) for what is not model state.
    options: estimate_memory's (precision, optimizer, mesh, ...); a stage
    or offload setting among them is what the table varies, so it is
    refused. On device "cpu" the device is the host: device_memory is not
    used, and the host must hold it all."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    for name in ("stage", "offload_optimizer", "offload_param", "config"):
        if name in options:
            raise ValueError(f"settings_that_fit tries every {name.replace('config', 'setting')}"
                             f"; leave {name} out")
    for name, value in (("device_memory", device_memory), ("host_memory", host_memory),
                        ("disk", disk)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number of bytes >= 0, got {value!r}")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or \
            not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
    local = min(world_size, 8) if local_ranks is None else local_ranks
    if isinstance(local, bool) or not isinstance(local, int) or local < 1:
        raise ValueError(f"local_ranks must be an integer >= 1, got {local_ranks!r}")
    if local > world_size:
        raise ValueError(f"local_ranks is {local} but world_size is {world_size}: a machine "
                         "cannot hold more of the run's ranks than the run has")
    on_gpu = str(device).startswith("cuda")
    usable = 1.0 - headroom
    # the settings the rule for a run's bytes reads (estimate_memory takes
    # optimizer and mesh besides the Config's fields)
    cfg = resolve_config(None, None, options.get("precision"),
                         {k: v for k, v in options.items()
                          if k not in ("optimizer", "mesh", "precision")})
    units = unit_totals(model, options.get("optimizer"), cfg, world_size)
    table = FitTable()
    for optimizer_place, param_place, stages in _OFFLOADS:
        for stage in stages:
            summary = estimate_memory(
                model, world_size, stage=stage, device=device,
                offload_optimizer=_block(optimizer_place),
                offload_param=_block(param_place), **options)
            run = _run_bytes(stage, cfg, *units)
            on_device = summary["params"] + summary["grads"] + \
                summary["optimizer_states"] + summary["frozen_params"] + run
            host = summary["host"]
            if not on_gpu:
                host, on_device = host + on_device, 0
            files = summary["offloaded"] + summary["params_offloaded"]
            fits = (not on_gpu or on_device <= usable * device_memory) and \
                host * local <= usable * host_memory and \
                (files == 0 or files * local <= usable * disk)
            table.append({"stage": stage, "offload_optimizer": optimizer_place,
                          "offload_param": param_place, "device": int(on_device),
                          "host": int(host), "disk": int(files), "fits": bool(fits)})
    return table


def _block(place):
    if place == "none":
        return {"device": "none"}
    return {"device": place, "nvme_path": _PLACEHOLDER_PATH} if place == "nvme" \
        else {"device": place}


def _run_bytes(stage, cfg, largest, trained, every):
    """What estimate_memory leaves to a run, by rule: the gradient buckets
    of stages 2-3 (MAX_IN_FLIGHT in flight plus the one filling, each
    reduce_bucket_size elements at most, in the compute dtype), and stage
    3's gathered units: the running unit (`largest`: the largest unit the
    engine lays out, a block by default), stage3_prefetch_bucket_size
    elements ahead of it within stage3_max_live_parameters in all (the
    running unit is gathered whatever the limit), plus the units kept
    within stage3_max_reuse_distance, which no limit releases. Neither
    holds more than the units it carries, padding included (`trained`:
    the trainable units' elements, `every`: all units'; unit_totals): a
    bucket small units share holds their padded chunks ([Note: small units
    share a bucket] in csrc/zero.h), and stage 2's lays its parameters
    out with the same gaps."""
    item = DTYPES[cfg.precision].itemsize
    extra = 0
    if stage >= 2:
        extra += min(trained, (MAX_IN_FLIGHT + 1) * cfg.reduce_bucket_size) * item
    if stage == 3:
        ahead = min(cfg.stage3_prefetch_bucket_size,
                    max(0, cfg.stage3_max_live_parameters - largest))
        extra += min(every, largest + ahead + cfg.stage3_max_reuse_distance) * item
    return extra

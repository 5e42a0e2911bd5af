"""The ranks agree on the model and the settings before any collective.

Every collective pairs buffers by position, not by meaning: ranks whose
models or settings differ would mix unrelated values silently (gloo
accepts a shorter message), abort inside gloo, or wait on each other for
good. So zero.initialize first compares, with one all-gather of one hash
per aspect, what every rank is about to lay out: the parameters (name,
shape, dtype, trainable, param group), the buffers, the stage and the
other settings that change the collectives or the numbers, and the
optimizer's kind and hyperparameters. A difference is raised on every
rank, naming the aspect and this rank's value of it.
"""
from __future__ import annotations

import dataclasses
import hashlib

import torch


# settings every rank must share; paths (nvme_path) may differ per rank
_SETTINGS = ("stage", "precision", "gradient_accumulation_steps", "gradient_clipping",
             "reduce_bucket_size", "bucket_reduction", "grad_accum_dtype",
             "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
             "stage3_prefetch_bucket_size",
             "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_leaf_modules")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


def _describe(tensor, dtype=True) -> str:
    kind = str(tensor.dtype).replace("torch.", "") if dtype else \
        "floating" if tensor.is_floating_point() else "integer"
    return f"{tuple(tensor.shape)} {kind}"


def aspects(module, optimizer, config) -> dict:
    """Aspect name -> this rank's description of it (a string)."""
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    # a parameter's floating dtype may differ: the engine casts them all
    params = [f"{name} {_describe(p, dtype=False)} {'trained' if p.requires_grad else 'frozen'} "
              f"group {group_of.get(id(p))}" for name, p in module.named_parameters()]
    buffers = [f"{name} {_describe(b)}" for name, b in module.named_buffers()]
    settings = [f"{k}={getattr(config, k)!r}" for k in _SETTINGS]
    units = config.units  # a callable by name: its repr holds an address
    settings.append(f"units={getattr(units, '__qualname__', None) or units!r}")
    settings.append(f"offload_optimizer.device={config.offload_optimizer.device!r}")
    scaling = config.loss_scaling
    if config.precision == "fp16" and dataclasses.is_dataclass(scaling):
        settings.append(f"loss_scaling={dataclasses.asdict(scaling)!r}")
    hyper = [f"{type(optimizer).__module__}.{type(optimizer).__name__}"]
    for gi, group in enumerate(optimizer.param_groups):
        items = sorted((k, _plain(v)) for k, v in group.items() if k != "params")
        hyper.append(f"group {gi}: {items}")
    return {"parameters": "; ".join(params), "buffers": "; ".join(buffers),
            "settings": "; ".join(settings), "optimizer": "; ".join(hyper)}


def _plain(value):
    """A hyperparameter as every rank would write it: numbers and strings
    as they are; another object by its type (its repr may hold an
    address)."""
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def check_ranks_agree(comm, module, optimizer, config, extra=None) -> None:
    """Raise on every rank unless every rank describes the same training
    (a collective: the first of the engine's). extra: more aspects, name
    -> this rank's description."""
    comm = comm.everyone  # every data-parallel rank, the replicas too
    if comm.world == 1:
        return
    described = {**aspects(module, optimizer, config), **(extra or {})}
    every = comm.gather_ints([_hash(v) for v in described.values()])
    for k, name in enumerate(described):
        values = [row[k] for row in every]
        if len(set(values)) > 1:
            groups = {}
            for rank, v in enumerate(values):
                groups.setdefault(v, []).append(rank)
            text = described[name]
            raise ValueError(
                f"the ranks differ in their {name} (ranks that agree: "
                f"{sorted(groups.values())}). Every rank must build the same model and pass the same "
                f"settings and optimizer to zero.initialize. This rank ({comm.rank}) has: "
                f"{text[:2000]}{' ...' if len(text) > 2000 else ''}")

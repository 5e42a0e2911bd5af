"""The optimizer a DeepSpeed config's "optimizer" block names, built with
DeepSpeed's defaults where they differ from torch's."""
from __future__ import annotations

import torch

import difflib

from zero.config._values import auto_refused, deepspeed_bool
from zero.optim.lion import Lion

_BLOCK_KEYS = ("type", "params")
_BLOCK_IGNORED = ("legacy_fusion",)  # DeepSpeed's fused-kernel switch of old: no effect here


def _checked_block(spec) -> tuple:
    """(type, params) of an "optimizer" block, or an error naming what is
    wrong: a typo of its keys left the rest of the block unread before
    ({"param": {"lr": 0.5}} trained at the default lr, {"typ": "SGD"} with
    AdamW)."""
    if not isinstance(spec, dict):
        raise ValueError(f"optimizer must be a block such as {{\"type\": \"AdamW\", "
                         f"\"params\": {{\"lr\": 1e-3}}}}, got {spec!r}")
    unknown = [k for k in spec if k not in _BLOCK_KEYS + _BLOCK_IGNORED]
    if unknown:
        hints = [f"{k!r}" + (f" (a typo of {close[0]!r}?)" if (close := difflib.get_close_matches(
            k, _BLOCK_KEYS, n=1, cutoff=0.6)) else "") for k in unknown]
        raise ValueError(f"optimizer: unknown key(s) {', '.join(hints)}; the block takes "
                         "\"type\" and \"params\"")
    kind, kwargs = spec.get("type", "AdamW"), spec.get("params", {})
    if not isinstance(kind, str):
        raise ValueError(f"optimizer.type must be a name such as \"AdamW\", got {kind!r}")
    if not isinstance(kwargs, dict):
        raise ValueError(f"optimizer.params must be a block of settings, got {kwargs!r}")
    return kind, dict(kwargs)


def optimizer_from_config(spec: dict, params):
    """Build the optimizer a DeepSpeed config's "optimizer" block names."""
    kind, kwargs = _checked_block(spec)
    for key, value in kwargs.items():
        if value == "auto":
            raise auto_refused(f"optimizer.params.{key}")
    for key in ("adam_w_mode", "torch_adam"):  # "false" is truthy: read as DeepSpeed reads it
        if key in kwargs:
            kwargs[key] = deepspeed_bool(kwargs[key], f"optimizer.params.{key}")
    if "betas" in kwargs:
        betas = kwargs["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError(f"optimizer.params.betas must be two numbers, got {betas!r}")
        kwargs["betas"] = tuple(betas)
    if kind.lower() in ("adam", "adamw") and not kwargs.get("torch_adam", False):
        # DeepSpeed's own Adam (FusedAdam, DeepSpeedCPUAdam) defaults to no
        # weight decay; torch's AdamW, which runs here, to 0.01
        kwargs.setdefault("weight_decay", 0.0)
        # FusedAdam's bias_correction (old configs write true): torch's
        # Adam always corrects
        if kwargs.pop("bias_correction", True) is not True:
            raise ValueError("optimizer.params.bias_correction: only true is supported "
                             "(torch's Adam, which runs here, always corrects the bias)")
    if kind.lower() == "lion":  # DeepSpeed's FusedLion and DeepSpeedCPULion defaults
        kwargs.setdefault("lr", 1e-3)
        kwargs.setdefault("betas", (0.9, 0.999))
    classes = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
               "adagrad": torch.optim.Adagrad, "lion": Lion}
    cls = classes.get(kind.lower())
    if cls is None:
        raise ValueError(f"optimizer.type {kind!r} is not supported; choose one of "
                         f"{sorted(classes)}")
    if kind.lower() == "adam" and kwargs.pop("adam_w_mode", True):
        cls = torch.optim.AdamW  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
    if kind.lower() == "adamw":
        kwargs.pop("adam_w_mode", None)  # DeepSpeed's "AdamW" is AdamW whatever it says
    kwargs.pop("torch_adam", None)
    return cls(params, **kwargs)

"""The optimizer a DeepSpeed config's "optimizer" block names, built with
DeepSpeed's defaults where they differ from torch's."""
from __future__ import annotations

import torch

from zero.config._values import auto_refused
from zero.optim.lion import Lion


def optimizer_from_config(spec: dict, params):
    """Build the optimizer a DeepSpeed config's "optimizer" block names."""
    kind = spec.get("type", "AdamW")
    kwargs = dict(spec.get("params", {}))
    for key, value in kwargs.items():
        if value == "auto":
            raise auto_refused(f"optimizer.params.{key}")
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
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

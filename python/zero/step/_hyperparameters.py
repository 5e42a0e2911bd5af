"""The checks every update path shares on an optimizer's settings, before
any element is touched: what torch's optimizers refuse at construction and
at step (a negative lr, a beta outside [0, 1), a string where a number
belongs, differentiable=True). zero.optim's constructors, the engine's step
paths and the torch-op updates all call these."""
from __future__ import annotations

import math
import numbers

import torch


NUMERIC_SETTINGS = ("lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay")


def check_number(name: str, value):
    """A hyperparameter must be a real number or a one-element tensor
    (torch's optimizers take a tensor lr); float() alone would take the
    string "0.01", which torch refuses."""
    if torch.is_tensor(value):
        if value.numel() == 1 and not value.is_complex():
            return
    elif isinstance(value, numbers.Real):  # numpy's scalars too
        return
    raise TypeError(f"{name} is {value!r} ({type(value).__name__}); it must be a number")


def check_group_settings(group: dict):
    """What the C core's argument checks cannot see in a param group, as
    torch's step would refuse it: differentiable=True (set after
    construction too) asks for a step autograd can differentiate, which an
    update outside autograd silently is not; and check_number over the
    numeric settings (float() would take an lr of "0.01")."""
    if group.get("differentiable", False):
        raise ValueError("differentiable=True: zero updates the parameters outside autograd, "
                         "so no gradient would flow through the step; set it to False")
    for key in NUMERIC_SETTINGS:
        if key in group:
            check_number(key, group[key])
    for beta in group.get("betas", ()):
        check_number("betas", beta)


def check_hyperparameters(**values) -> list:
    """Raise ValueError naming the first out-of-range hyperparameter (a
    beta in [0, 1), anything else finite and >= 0); the values as floats,
    in the order given."""
    floats = []
    for name, value in values.items():
        check_number(name, value)
        v = float(value)
        if name.startswith("beta"):
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        elif not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        floats.append(v)
    return floats

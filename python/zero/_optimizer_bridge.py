"""Which update runs for a user's optimizer, and with which of its
hyperparameters. The user's optimizer object stays the owner of the
hyperparameters (an LR scheduler edits its param_groups); the engine keeps
the states, partitioned, and runs the update on its own partition with
the functions _step_path.py picks (the C core, zero's kernels, torch ops)."""
from __future__ import annotations

import inspect

import torch

from zero import optim as zero_optim
from zero.config import auto_refused

SUPPORTED = "torch.optim.AdamW, Adam, SGD, Adagrad and zero.optim's AdamW, Adam, SGD, Lion, Adagrad"


def optimizer_kind(optimizer) -> str:
    _refuse_own_step(optimizer)
    # zero.optim's Adam/AdamW subclass FlatOptimizer; torch's do not subclass
    # each other, so exact checks against both families are enough.
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, zero_optim.Adam)):
        return "adam"
    if isinstance(optimizer, (torch.optim.SGD, zero_optim.SGD)):
        return "sgd"
    if isinstance(optimizer, (torch.optim.Adagrad, zero_optim.Adagrad)):
        return "adagrad"
    if isinstance(optimizer, zero_optim.Lion):
        return "lion"
    raise TypeError(f"optimizer of type {type(optimizer).__module__}.{type(optimizer).__name__} "
                    f"cannot be partitioned by zero; supported: {SUPPORTED}")


def _supported_classes() -> tuple:
    return (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
            zero_optim.Adam, zero_optim.AdamW, zero_optim.SGD, zero_optim.Adagrad,
            zero_optim.Lion)


def _refuse_own_step(optimizer):
    """A subclass of a supported optimizer that defines its own step(): the
    engine runs the base class's update on its partitions, so that step()
    would never run (its changes silently lost)."""
    mro = type(optimizer).__mro__
    base = next((cls for cls in mro if cls in _supported_classes()), None)
    if base is None:
        return  # not supported at all: optimizer_kind says so
    # torch wraps a class's step (profile_hook_step) at its first instance,
    # and a subclass made before its base had one gets the wrapper in its
    # own __dict__: a step is the subclass's own only if what it wraps is
    # not the base's
    inherited = {inspect.unwrap(vars(cls)["step"]) for cls in mro[mro.index(base):]
                 if "step" in vars(cls)}
    own = [cls for cls in mro[:mro.index(base)]
           if "step" in vars(cls) and inspect.unwrap(vars(cls)["step"]) not in inherited]
    if own:
        raise TypeError(
            f"optimizer of type {type(optimizer).__module__}.{type(optimizer).__qualname__} "
            f"defines its own step() (in {own[0].__qualname__}) over "
            f"{base.__module__}.{base.__qualname__}'s: zero runs {base.__qualname__}'s update "
            "itself, on each rank's partition, so that step() would never run. Use the base "
            "class, or zero.optim / torch.optim's own; supported: " + SUPPORTED)


def states_for(kind: str, group: dict) -> dict:
    """State name -> initial value, for one param group's settings."""
    if kind == "adam":
        names = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
        if group.get("amsgrad"):
            names["max_exp_avg_sq"] = 0.0
        return names
    if kind == "sgd":
        return {"momentum_buffer": 0.0} if group.get("momentum", 0) else {}
    if kind == "adagrad":
        return {"sum": float(group.get("initial_accumulator_value", 0.0))}
    return {"exp_avg": 0.0}


def fresh_states(optimizer, kind: str, group: dict) -> dict:
    """states_for, with the values a new `optimizer` starts them at. torch's
    Adagrad fills every parameter's sum at construction with the
    constructor's initial_accumulator_value, whatever a param group says
    (a group's own value is kept in the group and never used);
    zero.optim.Adagrad takes each group's."""
    states = states_for(kind, group)
    if kind == "adagrad" and isinstance(optimizer, torch.optim.Adagrad):
        states["sum"] = float(optimizer.defaults.get("initial_accumulator_value", 0.0))
    return states


def counts_as_step(kind: str, group: dict) -> bool:
    """Whether an update advances the group's step count. SGD counts only
    the updates that use the momentum buffer: torch starts the buffer as
    the gradient at the first of them, also after updates made with
    momentum 0 (a momentum warm-up), and keeps no step of its own. Before,
    the buffer started only at the group's first update: with dampening,
    a warm-up from 0 then trained on (1 - dampening) times the gradient."""
    return kind != "sgd" or float(group.get("momentum", 0.0)) != 0.0


def decoupled(optimizer, group) -> bool:
    # an AdamW decays decoupled whatever its groups say: a checkpoint of
    # Adam restores decoupled_weight_decay=False into them (torch's AdamW
    # forces True when it loads one too)
    if isinstance(optimizer, (torch.optim.AdamW, zero_optim.AdamW)):
        return True
    return bool(group.get("decoupled_weight_decay", False))


def parameter_names(module) -> dict:
    """id(parameter) -> its name in the module; a tied parameter goes by
    the name it is first registered under, as named_parameters gives it."""
    names = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    return names


def run_update(kind, optimizer, group, buffers, step, grad_scale, functions):
    """One update of a flat group's partition with `group`'s hyperparameters.
    buffers: "master", "grad", "copy_out" (None: the master is the
    parameters) and the states, as functions takes them (zero._C's
    functions take registered Buffers; _torch_update's take tensors).
    functions: kind -> the update with zero._C.<kind>_step's arguments."""
    b = buffers
    if group.get("maximize", False):
        grad_scale = -grad_scale
    lr = float(group["lr"])
    if kind == "adam":
        beta1, beta2 = (float(x) for x in group["betas"])
        functions["adam"](b["master"], b["grad"], b["exp_avg"], b["exp_avg_sq"],
                          b.get("max_exp_avg_sq"), b["copy_out"], lr=lr, beta1=beta1,
                          beta2=beta2, eps=float(group["eps"]),
                          weight_decay=float(group["weight_decay"]), step=step,
                          decoupled=decoupled(optimizer, group),
                          amsgrad=bool(group.get("amsgrad", False)), grad_scale=grad_scale)
    elif kind == "sgd":
        momentum = float(group.get("momentum", 0.0))
        functions["sgd"](b["master"], b["grad"], b.get("momentum_buffer") if momentum else None,
                         b["copy_out"], lr=lr, momentum=momentum,
                         dampening=float(group.get("dampening", 0.0)),
                         weight_decay=float(group.get("weight_decay", 0.0)),
                         nesterov=bool(group.get("nesterov", False)), first_step=step == 1,
                         grad_scale=grad_scale)
    elif kind == "adagrad":
        functions["adagrad"](b["master"], b["grad"], b["sum"], b["copy_out"], lr=lr,
                             lr_decay=float(group.get("lr_decay", 0.0)),
                             weight_decay=float(group.get("weight_decay", 0.0)),
                             eps=float(group.get("eps", 1e-10)), step=step,
                             grad_scale=grad_scale)
    else:
        beta1, beta2 = (float(x) for x in group["betas"])
        functions["lion"](b["master"], b["grad"], b["exp_avg"], b["copy_out"], lr=lr,
                          beta1=beta1, beta2=beta2,
                          weight_decay=float(group.get("weight_decay", 0.0)),
                          grad_scale=grad_scale)


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
               "adagrad": torch.optim.Adagrad, "lion": zero_optim.Lion}
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

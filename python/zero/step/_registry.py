"""The optimizer registry: one spec per optimizer zero can partition, read by
everything that needs to know an optimizer (docs/optimizers.md).

A spec says, in one place:
- its name (the kind a checkpoint records) and the torch.optim classes
  whose update it is (zero.optim's classes name their spec themselves, as
  the class attribute `spec`);
- its fp32 states, each with its initial value for a param group's
  settings, and which start as the first gradient instead (SGD's buffer);
- how a param group's hyperparameters map onto the update's arguments,
  which are the same for every path: zero._C's `<name>_step` (the host),
  step/_torch_update's function of the same name (any device), and, where
  `cuda_kernel`, zero's CUDA kernel (step/_step_path.py's CudaStep);
- whether an update advances the group's step count, and whether torch's
  state dict keeps a "step" for it.

Consumers: the engine (which states a partition holds, the update, the
count), zero.optim (its classes' updates and states), checkpoints and
consolidation (state names, the step entries), estimate_memory, the
DeepSpeed config reader and the HF Trainer integration. Adding an optimizer
is its spec here, its C function (csrc/) and CUDA kernel if any, its
torch-op update, and its tests.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from zero._C import adagrad_step, adam_step, lion_step, sgd_step
import zero.step._torch_update as _torch_update


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    torch_classes: tuple            # torch.optim classes that run this update
    states: Callable                # param group -> {state name: initial value}
    arguments: Callable             # see run_update
    host: Callable                  # zero._C's update over flat Buffers
    torch: Callable                 # the same update as torch ops
    cuda_kernel: bool = False       # zero's CUDA kernel runs it (else torch ops on a GPU)
    lazy_states: tuple = ()         # states that start as the first gradient
    counts_as_step: Callable = lambda group: True
    torch_keeps_step: bool = True   # torch's state dict has a "step" per parameter
    deepspeed_types: tuple = ()     # a DeepSpeed config's optimizer.type names for it
    trainer_optims: tuple = ()      # prefixes of the HF TrainingArguments.optim that build it


def _adam_states(group):
    names = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
    if group.get("amsgrad"):
        names["max_exp_avg_sq"] = 0.0
    return names


def _adam_arguments(group, b, step, first_step, decoupled):
    beta1, beta2 = (float(x) for x in group["betas"])
    return ((b["master"], b["grad"], b["exp_avg"], b["exp_avg_sq"], b.get("max_exp_avg_sq"),
             b["copy_out"]),
            dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                 weight_decay=float(group["weight_decay"]), step=step, decoupled=decoupled,
                 amsgrad=bool(group.get("amsgrad", False))))


def _sgd_states(group):
    return {"momentum_buffer": 0.0} if group.get("momentum", 0) else {}


def _sgd_arguments(group, b, step, first_step, decoupled):
    momentum = float(group.get("momentum", 0.0))
    return ((b["master"], b["grad"], b.get("momentum_buffer") if momentum else None,
             b["copy_out"]),
            dict(lr=float(group["lr"]), momentum=momentum,
                 dampening=float(group.get("dampening", 0.0)),
                 weight_decay=float(group.get("weight_decay", 0.0)),
                 nesterov=bool(group.get("nesterov", False)), first_step=first_step))


def _sgd_counts_as_step(group) -> bool:
    """SGD counts only the updates that use the momentum buffer: torch
    starts the buffer as the gradient at the first of them, also after
    updates made with momentum 0 (a momentum warm-up), and keeps no step
    of its own. (Counting every update, a warm-up from 0 with dampening
    then trained on (1 - dampening) times the gradient.)"""
    return float(group.get("momentum", 0.0)) != 0.0


def _adagrad_states(group):
    return {"sum": float(group.get("initial_accumulator_value", 0.0))}


def _adagrad_arguments(group, b, step, first_step, decoupled):
    return ((b["master"], b["grad"], b["sum"], b["copy_out"]),
            dict(lr=float(group["lr"]), lr_decay=float(group.get("lr_decay", 0.0)),
                 weight_decay=float(group.get("weight_decay", 0.0)),
                 eps=float(group.get("eps", 1e-10)), step=step))


def _lion_arguments(group, b, step, first_step, decoupled):
    beta1, beta2 = (float(x) for x in group["betas"])
    return ((b["master"], b["grad"], b["exp_avg"], b["copy_out"]),
            dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                 weight_decay=float(group.get("weight_decay", 0.0))))


ADAM = OptimizerSpec("adam", (torch.optim.Adam, torch.optim.AdamW), _adam_states,
                     _adam_arguments, adam_step, _torch_update.adam, cuda_kernel=True,
                     deepspeed_types=("adam", "adamw"), trainer_optims=("adamw",))
SGD = OptimizerSpec("sgd", (torch.optim.SGD,), _sgd_states, _sgd_arguments, sgd_step,
                    _torch_update.sgd, lazy_states=("momentum_buffer",),
                    counts_as_step=_sgd_counts_as_step, torch_keeps_step=False,
                    deepspeed_types=("sgd",), trainer_optims=("sgd",))
ADAGRAD = OptimizerSpec("adagrad", (torch.optim.Adagrad,), _adagrad_states, _adagrad_arguments,
                        adagrad_step, _torch_update.adagrad, deepspeed_types=("adagrad",),
                        trainer_optims=("adagrad",))
LION = OptimizerSpec("lion", (), lambda group: {"exp_avg": 0.0}, _lion_arguments, lion_step,
                     _torch_update.lion, deepspeed_types=("lion",), trainer_optims=("lion",))

SPECS = {spec.name: spec for spec in (ADAM, SGD, ADAGRAD, LION)}

SUPPORTED = "torch.optim.AdamW, Adam, SGD, Adagrad and zero.optim's AdamW, Adam, SGD, Lion, Adagrad"


def _own_spec(cls):
    """The spec a class names for itself (zero.optim's), or one whose
    torch classes include it exactly."""
    if "spec" in vars(cls) and isinstance(vars(cls)["spec"], OptimizerSpec):
        return vars(cls)["spec"]
    return next((s for s in SPECS.values() if cls in s.torch_classes), None)


def spec_for(optimizer) -> OptimizerSpec:
    """The spec of `optimizer`'s update: of its class, or of the nearest
    base class that has one; a subclass with its own step() is refused."""
    mro = type(optimizer).__mro__
    base = next((cls for cls in mro if _own_spec(cls) is not None), None)
    if base is None:
        raise TypeError(f"optimizer of type {type(optimizer).__module__}.{type(optimizer).__name__} "
                        f"cannot be partitioned by zero; supported: {SUPPORTED}")
    _refuse_own_step(optimizer, mro, base)
    return _own_spec(base)


def _refuse_own_step(optimizer, mro, base):
    """A subclass of a supported optimizer that defines its own step(): the
    engine runs the base class's update on its partitions, so that step()
    would never run (its changes silently lost)."""
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


def fresh_states(optimizer, spec: OptimizerSpec, group: dict) -> dict:
    """spec.states, with the values a new `optimizer` starts them at. torch's
    Adagrad fills every parameter's sum at construction with the
    constructor's initial_accumulator_value, whatever a param group says
    (a group's own value is kept in the group and never used);
    zero.optim.Adagrad takes each group's."""
    states = spec.states(group)
    if spec is ADAGRAD and isinstance(optimizer, torch.optim.Adagrad):
        states["sum"] = float(optimizer.defaults.get("initial_accumulator_value", 0.0))
    return states


def decoupled(optimizer, group) -> bool:
    """An AdamW decays decoupled whatever its groups say: a checkpoint of
    Adam restores decoupled_weight_decay=False into them (torch's AdamW
    forces True when it loads one too)."""
    if isinstance(optimizer, torch.optim.AdamW) or getattr(optimizer, "always_decoupled", False):
        return True
    return bool(group.get("decoupled_weight_decay", False))


def run_update(spec, optimizer, group, buffers, step, grad_scale, function, *,
               first_step=None, **extra):
    """One update with `group`'s hyperparameters over `buffers` ("master",
    "grad", "copy_out" (None: the master is the parameters) and the
    states), by `function`, which takes zero._C.<name>_step's arguments
    (spec.host, spec.torch, a kernel's wrapper). first_step: whether lazy
    states start now (default: step == 1); extra: start=, stop= for the
    C functions' ranges."""
    if group.get("maximize", False):
        grad_scale = -grad_scale
    args, kwargs = spec.arguments(group, buffers, step,
                                  step == 1 if first_step is None else first_step,
                                  decoupled(optimizer, group))
    function(*args, **kwargs, grad_scale=grad_scale, **extra)

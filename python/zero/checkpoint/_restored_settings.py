"""What engine.load_checkpoint sets besides tensors (the optimizer's
hyperparameters, the LR scheduler's state, the loss scale, the counters),
checked as user input is, before anything changes.

A checkpoint is data from a file, so none of it is applied on trust: a
param group's `params` key in the saved hyperparameters emptied the group
(every later save then failed to reload), and an LR scheduler state with
"optimizer": None replaced the scheduler's optimizer, so the next step()
raised after its update was applied. Each value is checked here, and the
hyperparameters (with the learning rate the restored schedule sets) run
through the same argument checks the step runs.
"""
from __future__ import annotations

import copy
import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from zero.config._config import FP32_MAX
from zero.config._cyclic_schedules import DeepSpeedStateDict
from zero.step._step_path import check_update_arguments

_OPTIMIZER_HINT = "; pass load_optimizer_states=False to start the optimizer afresh"
_SCHEDULER_HINT = "; pass load_lr_scheduler_states=False to keep the scheduler as it is"


def _count(value, what) -> int:
    # below 2^63: a count goes into torch's int64 (the optimizer's step)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2 ** 63:
        raise ValueError(f"the checkpoint's {what} is {value!r:.60}, not an integer in "
                         "[0, 2^63)")
    return value


def _check_counters(meta):
    engine = meta["engine"]
    for key in ("micro_steps", "global_steps"):
        _count(engine[key], key)
    if "skipped_steps" in engine:
        _count(engine["skipped_steps"], "skipped_steps")


def _check_groups(meta):
    for gi, saved in enumerate(meta["groups"]):
        _count(saved["step"], f"param group {gi} step count")
        for key in saved["hyper"]:
            if not isinstance(key, str) or key == "params":
                raise ValueError(f"the checkpoint's param group {gi} sets {key!r:.60} among "
                                 "its hyperparameters; a group's parameters come from the "
                                 "optimizer, never from a checkpoint" + _OPTIMIZER_HINT)


def _check_loss_scale(state):
    if not isinstance(state, dict):
        raise ValueError(f"the checkpoint's loss_scaler is a {type(state).__name__}, not a dict")
    scale = state.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
            not (math.isfinite(scale) and 0 < scale <= FP32_MAX):
        raise ValueError(f"the checkpoint's loss scale is {scale!r:.60}, not a number in "
                         f"(0, {FP32_MAX:.4g}] (fp32 holds no larger one)")
    _count(state.get("hysteresis_left"), "loss_scaler hysteresis_left")
    _count(state.get("good_steps"), "loss_scaler good_steps")


# what a saved state must never set on a scheduler: the optimizer it
# drives, and its methods (a number in place of step() breaks every step)
_NOT_STATE = frozenset(["optimizer"]) | frozenset(dir(LRScheduler))


def _same_form(saved, current, where, attributes=_NOT_STATE):
    """saved has current's form: lists of the same length, numbers for
    numbers (integers for integers but learning rates), strings for strings, dicts whose keys
    are kept. A key the scheduler does not keep is taken (another torch
    version's, such as an old `verbose`) unless it would replace one of its
    attributes (`attributes`: its optimizer, its methods)."""
    def refuse(what):
        raise ValueError(f"the checkpoint's {where} {what}, which the engine's LR scheduler "
                         "does not keep (saved with another scheduler?)" + _SCHEDULER_HINT)
    if isinstance(current, dict):
        if not isinstance(saved, dict):
            refuse(f"is a {type(saved).__name__}, not a dict")
        for key, value in saved.items():
            if key not in current:
                if not isinstance(key, str) or key in attributes or \
                        not isinstance(value, (int, float, str, bool, type(None))):
                    refuse(f"has the key {key!r:.60}")
                continue
            _same_form(value, current[key], f"{where}[{key!r}]")
    elif isinstance(current, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(current):
            refuse(f"is not a list of {len(current)}")
        for i, (s, c) in enumerate(zip(saved, current)):
            _same_form(s, c, f"{where}[{i}]")
    elif isinstance(current, bool):
        if not isinstance(saved, bool):
            refuse(f"is {saved!r:.60}, not a bool")
    elif isinstance(current, (int, float)):
        # a learning rate a script gave as an integer (SGD(lr=1)) holds
        # fractions later; counters, sizes and milestones stay integers (a
        # milestone of 2.5 would never be reached)
        kinds = int if isinstance(current, int) and not _rate(where) else (int, float)
        if isinstance(saved, bool) or not isinstance(saved, kinds):
            refuse(f"is {saved!r:.60}, not {'an integer' if kinds is int else 'a number'}")
    elif isinstance(current, str):
        if not isinstance(saved, str):
            refuse(f"is {saved!r:.60}, not a string")
    elif isinstance(current, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.layout != torch.strided or \
                saved.shape != current.shape:
            refuse(f"is not a dense tensor of shape {tuple(current.shape)}")


def _rate(where) -> bool:
    """Whether `where` (a path such as "lr_scheduler state['_last_lr'][0]")
    lies under a key that holds learning rates (base_lrs, _last_lr, max_lrs,
    min_lrs)."""
    if "['" not in where:
        return False
    return "lr" in where.rsplit("['", 1)[1].split("']", 1)[0].lower()


def _scheduler_lrs(scheduler, saved):
    """The learning rates the saved state would set (None if the scheduler
    keeps none): the state is loaded on trial and the scheduler put back."""
    current = scheduler.state_dict()
    attributes = _NOT_STATE | frozenset(dir(scheduler)) - set(current)
    if isinstance(scheduler, DeepSpeedStateDict):  # its load_state_dict reads DeepSpeed's
        attributes -= {"last_batch_iteration"}     # position, a property it does not overwrite
    _same_form(saved, current, "lr_scheduler state", attributes)
    before = copy.deepcopy(current)
    try:
        # load_state_dict may consume what it is given (LambdaLR pops)
        scheduler.load_state_dict(copy.deepcopy(saved))
        lrs = getattr(scheduler, "_last_lr", None)
        return None if lrs is None else list(lrs)
    except Exception as error:  # noqa: BLE001 - whatever the scheduler refuses
        raise ValueError(f"the checkpoint's lr_scheduler state does not load into the "
                         f"engine's {type(scheduler).__name__} ({type(error).__name__}: "
                         f"{error})" + _SCHEDULER_HINT) from error
    finally:
        scheduler.load_state_dict(before)


def check_restored_settings(engine, meta, with_optimizer: bool, load_module_only: bool,
                            load_lr_scheduler_states: bool):
    """Raise ValueError if anything load() would set besides the tensors
    is out of form or out of range; change nothing."""
    if load_module_only:
        return
    _check_counters(meta)
    if with_optimizer:
        _check_groups(meta)
    if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
        _check_loss_scale(meta["loss_scaler"])
    lrs = None
    if load_lr_scheduler_states and engine.lr_scheduler is not None and \
            meta["lr_scheduler"] is not None:
        lrs = _scheduler_lrs(engine.lr_scheduler, meta["lr_scheduler"])
    groups = engine.optimizer.param_groups
    steps = {fg.index: fg.step_count for fg in engine.groups}
    # every group, also one whose parameters are all frozen (no flat
    # group): its settings are set and the schedule reads them
    for index, group in enumerate(groups):
        candidate, step = dict(group), steps.get(index, 0)
        checks = []
        if with_optimizer:  # as saved (the schedule may set another lr over it)
            candidate.update(meta["groups"][index]["hyper"])
            step = meta["groups"][index]["step"]
            checks.append((dict(candidate), _OPTIMIZER_HINT))
        if lrs is not None and index < len(lrs):
            candidate["lr"] = lrs[index]
            checks.append((candidate, _SCHEDULER_HINT))
        for settings, hint in checks:
            try:
                check_update_arguments(engine._spec, engine.optimizer, settings, step + 1)
            except (ValueError, TypeError) as error:
                raise ValueError(f"the checkpoint would set param group {index}'s "
                                 f"hyperparameters out of range: {error}" + hint) from error

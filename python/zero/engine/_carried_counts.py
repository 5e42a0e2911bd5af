"""What an engine counts itself, carried from close() to the next
zero.initialize with the same optimizer in one process.

[Note: counts carried across close] close() at one rank gives the optimizer
its states back, so a new initialize with it (a re-run notebook cell, a
stage changed mid-run) goes on from them. The engine's own state went with
the engine: the new one started global_steps at 0 (a later save under the
default tag global_step<N> replaced the real step-N checkpoint, silently),
the fp16 dynamic loss scale at its initial value, and a schedule built from
the config at its first step (a warm-up began again). close() leaves these
on the optimizer beside its states, and the next initialize with that
optimizer takes them: the counters as a checkpoint's load sets them (the
micro-steps rounded up to a boundary of the new accumulation), the loss
scale where both engines scale dynamically, and a config-built schedule's
state where the new engine builds one from its config too (resumed on the
new config's curve, as a checkpoint's is). A torch scheduler the user passed
keeps its own state. On several ranks close() gives nothing back (the
states stay partitioned; a checkpoint carries all of this) and leaves
nothing here either.
"""
from __future__ import annotations

from zero.checkpoint._engine_load import set_counts, take_schedule_lrs

_KEY = "_zero_engine_counts"


def leave_counts(engine) -> None:
    """close(), at one rank: the engine's counts onto its optimizer."""
    optimizer = engine.optimizer
    if optimizer is None or engine._comm.everyone.world != 1:
        return
    scheduler = engine.lr_scheduler if getattr(engine, "_scheduler_from_config", False) \
        else None
    optimizer.__dict__[_KEY] = {
        "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        # a static scale is the config's, not a state to go on from
        "loss_scaler": engine.loss_scaler.state_dict()
        if engine.loss_scaler is not None and engine.loss_scaler.dynamic else None,
        "lr_scheduler": (type(scheduler).__name__, scheduler.state_dict())
        if scheduler is not None else None}


def take_counts(engine) -> None:
    """initialize, once the engine is built: the counts its optimizer
    carries from a closed engine, if any (taken once)."""
    carried = engine.optimizer.__dict__.pop(_KEY, None) if engine.optimizer is not None \
        else None
    if carried is None:
        return
    set_counts(engine, carried["micro_steps"], carried["global_steps"],
               carried["skipped_steps"])
    if engine.loss_scaler is not None and carried["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(carried["loss_scaler"])
    schedule = carried["lr_scheduler"]
    if schedule is not None and getattr(engine, "_scheduler_from_config", False) and \
            type(engine.lr_scheduler).__name__ == schedule[0]:
        engine.lr_scheduler.load_state_dict(schedule[1])
        take_schedule_lrs(engine)

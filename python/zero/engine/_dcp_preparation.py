"""torch.distributed.checkpoint's get_state_dict / get_optimizer_state_dict
on an engine's optimizer at stages 2-3: its preparation undone, and the
refusal naming the call.

[Note: DCP's preparation] Before reading an optimizer's states, DCP's
_init_optim_state fills them by a step of zero gradients at learning rate
0 when the optimizer has no torch-side state and no parameter a gradient:
the case at stages 2-3, whose states live partitioned in the engine and
whose .grad are None after each step. It sets every group's lr to 0 and
each .grad to zeros, then calls optimizer.step(), which the engine
refuses. torch then never puts the learning rates back: a script that
caught the error trained on at lr 0 without a word (stage 2), or failed in
the next backward on a zeros_like of a released placeholder (stage 3).
The refusal puts them back (from DCP's own list of them, read off its
frame) and drops the zero gradients, and says what to save with instead.
At stages 0-1 the gradients exist, DCP skips this, and its
optimizer.state_dict() call meets that call's own refusal. A load
(set_optimizer_state_dict) prepares the same way and is refused naming
engine.load_checkpoint. The HF Trainer's optimizer under ZeroTrainerMixin
is a stand-in whose step is engine.step() and whose state_dict() is a stub
for the Trainer's checkpoints: it refuses DCP's calls the same way.
"""
from __future__ import annotations

import sys

_PREPARATION = "_init_optim_state"
_DCP_MODULE = "torch.distributed.checkpoint"


def undo_dcp_preparation(optimizer) -> str | None:
    """If optimizer.step() was called by DCP's preparation: undo it and
    return the refusal's text; else None."""
    frame = _dcp_frame(sys._getframe(1), _PREPARATION)
    if frame is None:
        return None
    lrs = frame.f_locals.get("lrs")
    groups = [g for g in optimizer.param_groups if "lr" in g]
    restored = isinstance(lrs, list) and len(lrs) == len(groups)
    if restored:
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
    # DCP makes them only where every gradient was None
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
    again = "" if restored else (" It set every param group's lr to 0 before this and its "
                                 "values could not be read back: set them again.")
    return dcp_refusal(_loading(frame)) + again


def refuse_if_dcp(call: str) -> None:
    """Raise the refusal when DCP called `call` (an optimizer stand-in's
    state_dict or load_state_dict, which the HF Trainer's checkpoints read
    as a stub: DCP took it for the states, KeyError 'params')."""
    frame = _dcp_frame(sys._getframe(1))
    if frame is not None:
        raise RuntimeError(dcp_refusal(call == "load_state_dict" or _loading(frame)))


def dcp_refusal(loading: bool) -> str:
    if loading:
        return ("torch.distributed.checkpoint (set_state_dict / set_optimizer_state_dict) "
                "cannot load into this optimizer: a zero engine keeps its states partitioned "
                "in its own buffers. Load with engine.load_checkpoint(dir), from a checkpoint "
                "engine.save_checkpoint(dir) wrote (any world size and stage).")
    return ("torch.distributed.checkpoint (get_state_dict / get_optimizer_state_dict) cannot "
            "read this optimizer: a zero engine keeps its states partitioned in its own "
            "buffers. Save with engine.save_checkpoint(dir) (every rank; it loads at any world "
            "size and stage), or take the model's weights with engine.full_state_dict(); "
            "get_model_state_dict(model) alone works at stages 0-2.")


def _dcp_frame(frame, name=None):
    """The first frame of DCP's up the stack within a few calls (the hook
    and torch's step wrappers come between), named `name` if given."""
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_globals.get("__name__", "").startswith(_DCP_MODULE) and \
                (name is None or frame.f_code.co_name == name):
            return frame
        frame = frame.f_back
    return None


def _loading(frame) -> bool:
    """Whether DCP's call at `frame` is on the way to a load (its
    set_state_dict or set_optimizer_state_dict) rather than a read."""
    for _ in range(5):
        if frame is None or not frame.f_globals.get("__name__", "").startswith(_DCP_MODULE):
            return False
        if frame.f_code.co_name.startswith(("set_", "_load")):
            return True
        frame = frame.f_back
    return False

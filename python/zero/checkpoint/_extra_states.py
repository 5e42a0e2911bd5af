"""Modules' extra state (torch's get_extra_state / set_extra_state) in the
engine's state dicts and checkpoints.

[Note: extra state] A module whose class defines get_extra_state puts
what it returns into state_dict() under its prefix + "_extra_state": any
object, a tensor, a dict of counters, scaling metadata. It is neither a
parameter nor a buffer. The engine took every such entry for a buffer:
full_state_dict() and save_checkpoint() called .detach() on a dict and
failed, and a tensor one was saved but copied at load into the fresh
tensor get_extra_state returns, so set_extra_state never ran and the
state was lost silently. Now each is kept as what it is: in a checkpoint
under the meta's "extra_states" (checked as any client_state is: a
checkpoint holds values only, never code), and given back at load through
set_extra_state, as torch's load_state_dict does.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

SUFFIX = "_extra_state"  # torch's key for it, after the module's prefix


def extra_state_modules(module: nn.Module) -> dict:
    """{state dict key: submodule} of the modules in `module` that keep
    extra state, by every path state_dict() takes (a shared module under
    each of its names)."""
    found = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        if getattr(type(m), "get_extra_state", nn.Module.get_extra_state) is not \
                nn.Module.get_extra_state:
            found[f"{prefix}.{SUFFIX}" if prefix else SUFFIX] = m
    return found


def owner_name(key: str) -> str:
    """The name of the module whose extra state is under `key`."""
    return key[:-len(SUFFIX)].rstrip(".") or "(the model)"


def snapshot(value):
    """A copy of an extra state that later changes to the module leave
    alone: a tensor on the host in its own dtype, anything else deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


def set_extra_states(modules: dict, saved: dict):
    """Give each module (extra_state_modules' map) its saved extra state."""
    for key, m in modules.items():
        m.set_extra_state(saved[key])

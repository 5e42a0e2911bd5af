"""deepspeed.zero.register_external_parameter(module, param): DeepSpeed's
call, usually made in a module's __init__ (inside zero.Init, before any
engine exists), saying that the module's forward reads `param` without
registering it (a parent that calls F.linear(x, self.embed.weight)).
Stage 3 then gathers param around the module's forward and backward. With
no engine on the model yet, the pair is kept on the module and taken by
the stage-3 engine initialize makes (Stage3Schedule); with one, it goes
to that engine's schedule at once (Engine.register_external_parameter)."""
from __future__ import annotations

from torch import nn

_ATTRIBUTE = "_zero_external_parameters"


def register_external_parameter(module, parameter):
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"parameter must be a torch.nn.Parameter, got "
                        f"{type(parameter).__name__}")
    place = getattr(parameter, "_zero_place", None)
    if place is not None and place.schedule is not None:
        place.schedule.add_external(module, parameter)
        return
    kept = module.__dict__.setdefault(_ATTRIBUTE, [])
    if all(p is not parameter for p in kept):
        kept.append(parameter)


def registered_externals(root) -> list:
    """(module, parameter) pairs registered on root's modules before an
    engine existed."""
    return [(module, p) for module in root.modules()
            for p in module.__dict__.get(_ATTRIBUTE, ())]

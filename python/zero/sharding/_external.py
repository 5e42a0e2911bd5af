"""deepspeed.zero.register_external_parameter(module, param): DeepSpeed's
call, usually made in a module's __init__ (inside zero.Init, before any
engine exists), saying that the module's forward reads `param` without
registering it (a parent that calls F.linear(x, self.embed.weight)).
Stage 3 then gathers param around the module's forward and backward. With
no engine on the model yet, the pair is kept on the module and taken by
the stage-3 engine initialize makes (Stage3Schedule); with one, it goes
to that engine's schedule at once (Engine.register_external_parameter).
unregister_external_parameter undoes it."""
from __future__ import annotations

from torch import nn

_ATTRIBUTE = "_zero_external_parameters"
# the parameters the engine itself found a module's forward to read
# (nn.MultiheadAttention's out_proj, a ParameterList's owner): kept apart
# from the user's registrations, so unregistering one leaves them gathered
_NEEDED = "_zero_needed_parameters"


def register_external_parameter(module, parameter):
    _check_types(module, parameter)
    place = getattr(parameter, "_zero_place", None)
    if place is not None and place.schedule is not None:
        place.schedule.add_external(module, parameter)
    remember_external(module, parameter)


def remember_external(module, parameter):
    """Kept on the module whether or not an engine took it: unregister
    reads it, and an engine made later on the same model (after close)
    takes it again."""
    kept = module.__dict__.setdefault(_ATTRIBUTE, [])
    if all(p is not parameter for p in kept):
        kept.append(parameter)


def unregister_external_parameter(module, parameter):
    """DeepSpeed's reverse of register_external_parameter: the module's
    forward no longer gathers `parameter`. Refused (RuntimeError, as
    DeepSpeed's) for a parameter not registered on the module. Under a
    stage-3 engine its unit leaves the module's list unless the module
    needs it anyway: it holds one of the module's own parameters or one
    still registered on it."""
    _check_types(module, parameter)
    kept = module.__dict__.get(_ATTRIBUTE, [])
    if all(p is not parameter for p in kept):
        raise RuntimeError(f"the parameter is not a registered external parameter of "
                           f"{type(module).__name__} (register_external_parameter)")
    kept[:] = [p for p in kept if p is not parameter]
    place = getattr(parameter, "_zero_place", None)
    schedule = place.schedule if place is not None else None
    if schedule is None:
        return
    entry = schedule.place.get(id(parameter))
    units = schedule.units_of.get(module)
    if entry is None or units is None:
        return
    # what the module gathers as its own: a unit root's every parameter,
    # another module's its direct ones (Stage3Schedule.__init__)
    own = module.parameters() if schedule.unit_roots.root(module) is module else \
        module._parameters.values()
    needed = module.__dict__.get(_NEEDED, {}).values()
    still = [schedule.place.get(id(p)) for p in [*own, *kept, *needed] if p is not None]
    if any(e is not None and e[1] is entry[1] for e in still):
        return
    # the list itself: the module's hooks read it (_whole_check in _stage3.py)
    units[:] = [(fg, u) for fg, u in units if u is not entry[1]]
    schedule._in_order = {}  # the recorded pass order named the unit here


def add_needed_external(schedule, module, parameter):
    """The engine's own finding that `module` reads `parameter` (see
    _NEEDED): gathered around the module's forward, as registered."""
    schedule.add_external(module, parameter)
    # by id: a list's membership walk made a 40,000-entry ParameterList's
    # initialize quadratic (20 s)
    module.__dict__.setdefault(_NEEDED, {}).setdefault(id(parameter), parameter)


def _check_types(module, parameter):
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"parameter must be a torch.nn.Parameter, got "
                        f"{type(parameter).__name__}")


def registered_externals(root) -> list:
    """(module, parameter) pairs registered on root's modules before an
    engine existed."""
    return [(module, p) for module in root.modules()
            for p in module.__dict__.get(_ATTRIBUTE, ())]

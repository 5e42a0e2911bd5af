"""Stage 3: a forward that reads another module's released parameter by
attribute gets it gathered ([Note: parameters read by attribute]).

[Note: parameters read by attribute] A unit is gathered around the
forward of the module that owns it. A forward that reads another
module's weight (a decoder tied by `F.linear(h, self.embed.weight)`, a
penalty `self.fc.weight.pow(2).sum()` in the loss a model returns, a
position table read as `self.pos.weight`) got the released placeholder:
torch's shape error ("size mismatch ... vec (0)"), or, for a reduction,
a silent 0.0. DeepSpeed gathers such a parameter when it is read by
attribute inside a forward and registers it as external to the module
running then, so later passes gather it up front; code written for ZeRO-3
counts on that. Here the same: each module that holds a parameter of a
released unit gets a `_parameters` dict whose item lookup (what
`module.weight` is, through nn.Module.__getattr__) sees a released
parameter read while a hooked module's forward runs, and asks the
schedule (Stage3Schedule.read_in_forward) to register it on the innermost
running module and gather it now: a collective, at the same point on
every rank, as every rank runs the same forward. Reads through
`parameters()` / `named_parameters()` (items, not item lookups) and reads
outside a forward are not seen, as under DeepSpeed (engine.md: use
zero.GatheredParameters there). The lookup costs a Python call per
attribute read of a parameter in a forward; close() puts plain dicts back.
"""
from __future__ import annotations

from zero.sharding._ds_attributes import NOT_AVAILABLE


class _WatchedParameters(dict):
    """A module's `_parameters`, whose item lookup sees a released
    parameter read in a forward. Pickled (and copied) as a plain dict."""
    __slots__ = ("schedule",)

    def __getitem__(self, key):
        param = dict.__getitem__(self, key)
        if param is not None and self.schedule.running and \
                getattr(param, "ds_status", None) is NOT_AVAILABLE:
            self.schedule.read_in_forward(param)
        return param

    def __reduce__(self):
        return dict, (dict(self),)


def watch_parameter_reads(schedule, root) -> list:
    """Give each of root's modules that holds a parameter of a released
    unit a watched `_parameters`; returns handles whose remove() puts a
    plain dict back (with what the module holds then)."""
    released = {id(p) for fg in schedule.groups for unit in fg.units
                if not unit.persistent for p in unit.params}
    handles = []
    for module in root.modules():
        own = module.__dict__.get("_parameters")
        if type(own) is not dict or not any(id(p) in released for p in own.values()):
            continue
        watched = _WatchedParameters(own)
        watched.schedule = schedule
        module.__dict__["_parameters"] = watched
        handles.append(_Unwatch(module))
    return handles


class _Unwatch:
    __slots__ = ("module",)

    def __init__(self, module):
        self.module = module

    def remove(self):
        own = self.module.__dict__.get("_parameters")
        if type(own) is _WatchedParameters:
            self.module.__dict__["_parameters"] = dict(own)

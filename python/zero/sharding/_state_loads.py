"""model.load_state_dict(...) at stage 3, unit by unit.

[Note: state dict loads at stage 3] A released parameter is an empty
placeholder, so torch's load_state_dict refused every one of them on its
shape ("size mismatch ... torch.Size([0])"), though writes into the
parameters after initialize are kept at every other stage. Each hooked
module (a unit root) gets a load-state-dict pre-hook that gathers its
units, as zero.GatheredParameters does, when the state dict holds a key of
one of their parameters, and a post-hook, run once the module and
everything below it are loaded, that takes the written values into the
partitions and releases the units. So a load holds one unit at a time
(plus those of the modules it is nested in), never the whole model, and a
state dict with a few keys (PEFT's adapters) gathers only their units.
Like GatheredParameters it is a collective: every rank loads, with the
same values (the writes are agreed over the ranks before they are taken
in: [Note: writes agreed] in _step_agreement.py), as HuggingFace does
under DeepSpeed stage 3 with its own GatheredParameters per module.
"""
from __future__ import annotations

from zero.sharding._copying import ModuleHook
from zero.sharding._gathered import GatheredParameters
from zero.sharding._param_writes import take_in_parameter_writes


class StateLoads:
    """The pre- and post-hook of one hooked module; `units` is the
    schedule's (fg, unit) list for it, which add_external may extend."""

    def __init__(self, module, units):
        self.units = units
        self.module = module
        self.open = []  # the GatheredParameters entered, innermost last

    def _names(self) -> dict:
        """The state dict keys (below the module's prefix) of the units'
        parameters, by the module's own naming."""
        ids = {id(p) for _fg, unit in self.units for p in unit.params}
        return {name: p for name, p in self.module.named_parameters(remove_duplicate=False)
                if id(p) in ids}

    def before(self, _module, state_dict, prefix, *_rest):
        names = self._names()
        if not any(prefix + name in state_dict for name in names) or \
                all(unit.active > 0 for _fg, unit in self.units):
            # nothing of ours to load, or inside a zero.GatheredParameters
            # that gathered the units and takes the writes in itself (which
            # HuggingFace enters on every rank to load on rank 0 alone):
            # no collective here
            self.open.append(None)
            return
        gathered = GatheredParameters([p for _fg, unit in self.units for p in unit.params])
        gathered.__enter__()
        self.open.append(gathered)

    def after(self, _module, _incompatible):
        gathered = self.open.pop() if self.open else None
        if gathered is None:
            return
        try:
            groups = list({id(fg): fg for fg, _unit in self.units}.values())
            take_in_parameter_writes(groups, gathered._call_text("load_state_dict"))
        finally:
            gathered.__exit__(None, None, None)


def hook_state_loads(module, units) -> list:
    """The two hooks' handles, for the schedule to remove at close(). A copy
    of the model gets hooks that do nothing (_copying.py)."""
    loads = StateLoads(module, units)
    return [module.register_load_state_dict_pre_hook(ModuleHook(loads.before)),
            module.register_load_state_dict_post_hook(ModuleHook(loads.after))]

"""Stage 3: a module run while its unit is released, refused by name.

[Note: roots never called] A unit is gathered around its root's forward
only (_unit_roots.py): the modules inside a root have no hooks, which is
what makes a block one gather a pass. Code that calls a module inside a
block without calling the block (an nn.Sequential iterated layer by layer,
Reformer's reversible layers calling their sublayers in the backward) ran
it on the released placeholders, and torch's shape error ("mat2 must be a
matrix, got 1-D tensor") named nothing a user could act on. So at first
each module inside a unit that holds parameters of its own has a
pre-forward hook that refuses to run on its released unit, naming the
module, its root and the remedy. The hooks go after the second backward
ends (two training passes: where such code shows itself), or after
WATCHED_FORWARDS root forwards without them (evaluation, generation, a
sanity check before training): their cost, a call into Python per module,
is what units by block save. A path taken only later still meets torch's
error. Under torch.compile the hooks stand aside: run outside the graph,
they would split it at every module, and the compiled code kept the
breaks after the hooks went.
"""
from __future__ import annotations

import torch

from zero.sharding._copying import ModuleHook
from zero.sharding._units import units_of_params

WATCHED_BACKWARDS = 2  # backwards ended before the watch goes
WATCHED_FORWARDS = 8   # or root forwards, whichever comes first


class _WatchHook(ModuleHook):
    """A ModuleHook (a copy or pickle of the model gets a no-op) that
    dynamo traces as nothing rather than running it outside the graph."""

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return None
        return self.function(*args, **kwargs)


def watch_uncalled_roots(schedule, root, roots) -> list:
    """The hooks of [Note: roots never called] on `root`'s modules inside
    unit roots (roots: the _unit_roots.UnitRoots), for schedule (a
    Stage3Schedule, whose `place` maps id(parameter) -> (group, unit))."""
    names = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    handles = []
    for module in root.modules():
        unit_root = roots.root(module)
        if unit_root is None or unit_root is module:
            continue
        units = [unit for _fg, unit in
                 units_of_params(module._parameters.values(), schedule.place)]
        if units:
            refuse = _refusal(schedule, names.get(id(module), type(module).__name__), module,
                              names.get(id(unit_root), ""), unit_root,
                              roots.is_leaf(unit_root), units)
            handles.append(module.register_forward_pre_hook(_WatchHook(refuse)))
    if not handles:
        return []
    seen = {"forwards": 0, "backwards": 0}

    def stand_aside():
        for handle in handles:
            handle.remove()
        handles.clear()

    def count_forward(_module, _args):
        seen["forwards"] += 1
        if seen["forwards"] > WATCHED_FORWARDS:
            stand_aside()

    def count_backward():
        seen["backwards"] += 1
        if handles and seen["backwards"] >= WATCHED_BACKWARDS:
            stand_aside()
    schedule.backward.after_end.append(count_backward)
    handles.append(root.register_forward_pre_hook(_WatchHook(count_forward)))
    return list(handles)


def _refusal(schedule, name, module, root_name, unit_root, leaf, units):
    remedy = (f"'{root_name}' is a stage3_leaf_modules module (gathered whole around its "
              "forward, whatever `units` says): call it rather than its members, or leave it "
              "out of stage3_leaf_modules") if leaf else (
              "Pass units='module' to zero.initialize (each module gathers its own "
              "parameters), or units=[the classes whose forward is called], or read them "
              "inside zero.GatheredParameters")

    def refuse(_module, _args):
        if schedule.suspended:  # a generation gathered every unit: hooks stand aside
            return
        if all(u.persistent or (u.gathered and u.work is None) for u in units):
            return
        raise RuntimeError(
            f"stage 3: module '{name}' ({type(module).__name__}) runs while its parameters "
            f"are released: they are gathered around the forward of '{root_name or 'the model'}' "
            f"({type(unit_root).__name__}), the unit they belong to, and that forward is not "
            "running (the code calls the module without calling its unit's root: a "
            "container iterated, a layer called from outside its block, or in a custom "
            f"backward). {remedy}")
    return refuse

"""Stage 3: a module run while its unit is released, refused by name.

[Note: roots never called] A unit is gathered around its root's forward
only (_unit_roots.py): the modules inside a root have no hooks, which is
what makes a block one gather a pass. Code that calls a module inside a
block without calling the block (an nn.Sequential iterated layer by layer,
Reformer's reversible layers calling their sublayers in the backward) ran
it on the released placeholders, and torch's shape error ("mat2 must be a
matrix, got 1-D tensor") named nothing a user could act on. So on the
first two passes (forward, backward, forward, backward: where such code
shows itself), each module inside a unit that holds parameters of its own
has a pre-forward hook that refuses to run on its released unit, naming
the module, its root and the remedy. Then the hooks go: their cost, a call
into Python per module, is what units by block save. A path taken only
later (an evaluation branch) still meets torch's error.
"""
from __future__ import annotations

from zero.sharding._copying import ModuleHook

WATCHED_FORWARDS = 2  # root forwards (and the backwards after them) watched


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
        units = {}
        for p in module._parameters.values():
            if p is not None and id(p) in schedule.place:
                unit = schedule.place[id(p)][1]
                units[id(unit)] = unit
        if units:
            refuse = _refusal(schedule, names.get(id(module), type(module).__name__),
                              module, names.get(id(unit_root), ""), unit_root,
                              list(units.values()))
            # a ModuleHook: a copy or pickle of the model gets a no-op, and
            # dynamo runs it as Python (_copying.py)
            handles.append(module.register_forward_pre_hook(ModuleHook(refuse)))
    if not handles:
        return []
    forwards = [0]

    def count(_module, _args):
        forwards[0] += 1
        if forwards[0] > WATCHED_FORWARDS:
            for handle in handles:
                handle.remove()
            counter.remove()
    counter = root.register_forward_pre_hook(ModuleHook(count))
    return handles + [counter]


def _refusal(schedule, name, module, root_name, unit_root, units):
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
            "backward). Pass units='module' to zero.initialize (each module gathers its "
            "own parameters), or units=[the classes whose forward is called], or read them "
            "inside zero.GatheredParameters")
    return refuse

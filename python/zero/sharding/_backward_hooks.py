"""Stage 3: a module's own backward hooks run with its parameters
gathered ([Note: module backward hooks]).

[Note: module backward hooks] torch wraps a module's output for its
backward hooks after the forward hooks have run, so the module's backward
pre-hooks (register_full_backward_pre_hook) fire before stage 3's own hook
on those outputs gathers the module's units again, and its full backward
hook fires once the inputs' gradients are in, when the units have
usually gone with their own gradients. A hook that read the module's
weights (a gradient scaled by a weight's mean) read the (0,) placeholder:
a NaN, and every parameter NaN after the step, silently. So each backward
hook a module has when initialize runs (full, pre, and the old
register_backward_hook) is wrapped: the module's units are gathered around
the call (a unit root's: a block's hook reads its children's weights too;
else its own parameters'; never every unit below it, so a hook on the
whole model does not gather the whole model). A unit the
wrapper gathered is released after a hook that runs once gradients are
in, and kept after a pre-hook (the module's backward gathers it next
anyway). Every rank runs the same hooks in autograd's order, so the
gathers pair up. Hooks registered after initialize are not wrapped
(docs/stage3.md, Limits), as forward hooks registered after it run after
the release. close() puts the hooks back as they were."""
from __future__ import annotations

import functools


def gather_around_backward_hooks(schedule, root, place) -> list:
    """Wrap the backward hooks of root's modules; returns handles whose
    remove() puts each hook back. place: id(parameter) -> (group, unit)."""
    handles = []
    for module in root.modules():
        hooks = [(module._backward_pre_hooks, False), (module._backward_hooks, True)]
        if not any(table for table, _ in hooks):
            continue
        entries = own_units(schedule, module, place)
        if not entries:
            continue
        for table, after_grads in hooks:
            for key, hook in list(table.items()):
                table[key] = _gathering(schedule, entries, hook, after_grads)
                handles.append(_Unwrap(table, key, hook))
    return handles


def own_units(schedule, module, place) -> list:
    """The units a module's hooks gather: a unit root's (a block's, its
    children's parameters included), else those of the module's own
    parameters. Not every unit below it: a hook on the whole model (a
    gradient monitor) gathered the whole model at every backward."""
    entries = schedule.units_of.get(module)
    if entries is not None:
        return list(entries)
    found, seen = [], set()
    for p in module.parameters(recurse=False):
        entry = place.get(id(p))
        if entry is not None and id(entry[1]) not in seen:
            seen.add(id(entry[1]))
            found.append(entry)
    return found


def _gathering(schedule, entries, hook, after_grads):
    @functools.wraps(hook)
    def run(*args, **kwargs):
        if schedule.removed or schedule.suspended:
            return hook(*args, **kwargs)
        gathered_here = [(fg, unit) for fg, unit in entries
                         if not unit.gathered and not unit.persistent]
        for fg, unit in gathered_here:
            schedule.ensure(fg, unit)
        try:
            return hook(*args, **kwargs)
        finally:
            if after_grads:
                for _fg, unit in gathered_here:
                    schedule.release(unit)
    return run


class _Unwrap:
    """remove(): the original hook back in its table, unless the user
    removed the hook meanwhile (its handle deletes the key)."""
    __slots__ = ("table", "key", "hook")

    def __init__(self, table, key, hook):
        self.table, self.key, self.hook = table, key, hook

    def remove(self):
        if self.key in self.table:
            self.table[self.key] = self.hook

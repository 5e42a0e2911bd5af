"""Which modules stage 3 gathers as one unit: the roots of the units.

[Note: units by block]
- A unit root's parameters, and those of every module below it, are one
  unit: gathered before the root's forward (and its backward), released
  after, with hooks on the root alone. Fewer, larger units mean fewer
  hooks and collectives a step, for the memory of one block gathered.
- `units="block"` (the default): the repeated blocks of the model. A
  HuggingFace model names them (`_no_split_modules`, the classes it never
  splits across devices: its decoder layers); otherwise a block is a
  module class of which some module has two or more children that hold
  parameters (a transformer's layers in a ModuleList, a ResNet stage's
  blocks). The outermost match wins, so the layers inside a block are
  part of it. Modules in no block (embeddings, a final norm, a head) are
  units of their own parameters, as with "module".
- `units="module"`: each module's own parameters a unit (every module
  that holds parameters is hooked).
- `units=(classes or class names)` or `units=callable(module) -> bool`:
  those modules are the roots.
- A container (nn.ModuleList, nn.ModuleDict: a class without a forward of
  its own) is never a root: its forward never runs, so hooks on it would
  never gather its members (a ModuleList of ModuleLists of layers, PEFT's
  lora_A/lora_B ModuleDicts, made the repeated class, crashed the first
  forward). The repeat count skips them; naming one is refused. A block
  whose forward exists but is not called (an nn.Sequential iterated)
  is caught on the first passes ([Note: roots never called] in
  _uncalled_roots.py).
- A PEFT adapter layer (a class under peft's BaseTunerLayer: LoRA's
  Linear, DoRA, LoHa, LoKr, trainable tokens) in no other root is a root
  with its base layer: its forward reads the base layer's weight (and
  DoRA's its lora_A's) without calling them, so with units="module", or
  on a layer outside the blocks (lm_head, embed_tokens), those reads met
  the released placeholders.
- stage3_leaf_modules are roots too, with the leaf rules (no bucket waits
  for their parameters: the experts a rank's tokens skip), and a root
  that holds a leaf module takes those rules for its whole unit. So is a
  module marked with DeepSpeed's `_z3_leaf` attribute (set by
  deepspeed.utils.set_z3_leaf_modules, zero.deepspeed's included).
"""
from __future__ import annotations

from torch import nn


class UnitRoots:
    def __init__(self, root_of: dict, leaves: set):
        self.root_of = root_of  # id(module) -> the unit root it is or lies in
        self.leaves = leaves    # ids of the roots with the leaf rules

    def root(self, module):
        return self.root_of.get(id(module))

    def is_leaf(self, module) -> bool:
        return id(module) in self.leaves


def unit_roots(model: nn.Module, units="block", leaf_modules=()) -> UnitRoots:
    named_leaf = module_matcher(leaf_modules, model, "stage3_leaf_modules")
    leaf = lambda m: named_leaf(m) or getattr(m, "_z3_leaf", False) is True  # noqa: E731
    if units == "module":
        chosen = lambda _m: False  # noqa: E731
    elif units == "block":
        chosen = module_matcher(block_classes(model), model, None)
    elif callable(units) and not isinstance(units, type):
        chosen = units
    else:
        chosen = module_matcher(tuple(units) if isinstance(units, (list, tuple)) else (units,),
                          model, "units")
    root_of, leaves = {}, set()
    for m in model.modules():  # parents before children: the outermost wins
        if id(m) in root_of:
            continue
        is_leaf = leaf(m)
        if not is_leaf and not chosen(m) and not is_adapter_layer(m):
            continue
        if is_container(m):
            if units == "block" and not is_leaf:
                continue  # not counted by block_classes; a _no_split_modules name
            what = "units" if not is_leaf else "stage3_leaf_modules" if named_leaf(m) else \
                "deepspeed.utils.set_z3_leaf_modules"
            raise ValueError(
                f"{what}: {type(m).__name__} modules are containers whose forward never runs, "
                "so they cannot be gathered around it; name the modules that are called "
                "(its members, or the module that calls them)")
        for inner in m.modules():
            root_of.setdefault(id(inner), m)
            is_leaf = is_leaf or leaf(inner)
        if is_leaf:
            leaves.add(id(m))
    return UnitRoots(root_of, leaves)


def block_classes(model: nn.Module) -> tuple:
    """The model's block classes, by name: a HuggingFace model's
    `_no_split_modules` that it holds, else every class of which some
    module has two or more children holding parameters."""
    present = {type(m).__name__ for m in model.modules()}
    named = getattr(model, "_no_split_modules", None) or ()
    named = tuple(n for n in named if isinstance(n, str) and n in present)
    if named:
        return named
    repeated = set()
    for m in model.modules():
        counts = {}
        for child in m.children():
            if not is_container(child) and any(True for _ in child.parameters()):
                counts[type(child)] = counts.get(type(child), 0) + 1
        repeated.update(t.__name__ for t, n in counts.items() if n >= 2)
    return tuple(sorted(repeated))


def is_adapter_layer(module) -> bool:
    """A PEFT tuner layer (known by its class's bases, so peft need not be
    imported): it reads its members' weights in its own forward."""
    return any(c.__name__ == "BaseTunerLayer" and c.__module__.startswith("peft.")
               for c in type(module).__mro__)


def is_container(module) -> bool:
    """A module whose class has no forward of its own (nn.ModuleList,
    nn.ModuleDict, nn.ParameterList): calling it is an error, so it never
    runs a forward."""
    return type(module).forward is nn.Module.forward


def module_matcher(specs, model, setting):
    """module -> whether it matches one of specs (classes or class names).
    setting: the option's name, to refuse a spec no module matches."""
    if not specs:
        return lambda _m: False
    names = {x for x in specs if isinstance(x, str)}
    types = tuple(x for x in specs if isinstance(x, type))
    if setting is not None:
        present = {type(m) for m in model.modules()}
        for spec in specs:
            if not any(t.__name__ == spec if isinstance(spec, str) else issubclass(t, spec)
                       for t in present):
                raise ValueError(f"{setting}: no module of the model is a {spec!r}")
    return lambda m: type(m).__name__ in names or isinstance(m, types)

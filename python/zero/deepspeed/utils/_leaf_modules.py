"""deepspeed.utils' leaf-module functions: a model's modules marked as
stage-3 leaves (the `_z3_leaf` attribute DeepSpeed's functions set), which
zero.initialize reads beside its stage3_leaf_modules setting ([Note: units
by block] in sharding/_unit_roots.py): each marked module is gathered
whole as one unit, with no hooks inside it."""
from __future__ import annotations

from torch import nn

from zero.sharding._unit_roots import module_matcher

LEAF_MARK = "_z3_leaf"


def _checked(model, classes, call):
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(classes, (str, type)):
        classes = [classes]
    classes = list(classes)
    if not classes or not all(isinstance(c, str) or (isinstance(c, type) and
                                                     issubclass(c, nn.Module))
                              for c in classes):
        raise TypeError(f"{call}: leaf_module_classes must be a non-empty list of "
                        f"nn.Module classes or class names, got {classes!r}")
    return classes


def _mark(model, classes, flag, call) -> list:
    classes = _checked(model, classes, call)
    matches = module_matcher(classes, model, None)
    marked = [m for m in model.modules() if matches(m)]
    if not marked:
        raise ValueError(f"{call}: no module of the model is one of {classes!r}")
    for m in marked:
        setattr(m, LEAF_MARK, flag)
    return marked


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes) -> list:
    """Mark every module of `model` that is one of leaf_module_classes
    (classes or class names) a stage-3 leaf; the marked modules."""
    return _mark(model, leaf_module_classes, True, "set_z3_leaf_modules")


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes) -> list:
    """Take the mark off again; the modules it was taken off."""
    return _mark(model, leaf_module_classes, False, "unset_z3_leaf_modules")


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether `module` is marked a stage-3 leaf."""
    return bool(getattr(module, LEAF_MARK, False))


def get_z3_leaf_modules(model: nn.Module) -> list:
    """The modules of `model` marked stage-3 leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]

"""What the engine sets on the user's optimizer and model objects while it
trains them, since torch has no hook for these calls: zero_grad routed to
the engine (the optimizer's, the model's, each submodule's), the optimizer's
state_dict refused, and the handles that take these attributes away again at
close(). Every route holds its engine weakly."""
from __future__ import annotations

import weakref


def call_alive(engine_ref, function, *args):
    """function(engine, *args) for a hook that holds its engine weakly; nothing
    once the engine is gone or closed."""
    engine = engine_ref()
    if engine is not None and not engine._closed:
        return function(engine, *args)
    return None


def _zero_grad(engine, set_to_none):
    engine.zero_grad(set_to_none)


def _zero_grads_of(engine, params):
    engine._zero_grads_of(params)


class EngineZeroGrad:
    """optimizer.zero_grad while an engine drives the optimizer: the
    engine's zero_grad (held weakly, like the hooks)."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)

    def __call__(self, set_to_none: bool = True):
        call_alive(self._engine, _zero_grad, set_to_none)


def model_zero_grad(self, set_to_none: bool = True):
    """model.zero_grad while an engine trains the model: the model class's
    own, then the engine's, which also drops the gradients stages 2-3 have
    reduced already. A copy of the model (deepcopy binds this to the copy,
    whose _zero_engine is None) gets the class's alone."""
    type(self).zero_grad(self, set_to_none)
    ref = self.__dict__.get("_zero_engine")
    if ref is not None:
        call_alive(ref, _zero_grad, set_to_none)


def submodule_zero_grad(self, set_to_none: bool = True):
    """A submodule's zero_grad while an engine trains its model: the
    module class's own, then each engine training its parameters drops
    their gradients since the last step. A copy's parameters have no place,
    so a copy gets the class's alone."""
    type(self).zero_grad(self, set_to_none)
    by_engine = {}
    for p in self.parameters():
        place = getattr(p, "_zero_place", None)
        if place is not None:
            by_engine.setdefault(place.engine, []).append(p)
    for ref, params in by_engine.items():
        call_alive(ref, _zero_grads_of, params)


# a pickled bound method is rebuilt as getattr(model, __name__): the class's
model_zero_grad.__name__ = "zero_grad"
submodule_zero_grad.__name__ = "zero_grad"


def refuse_states_call(name):
    def refuse(*_args, **_kwargs):
        raise RuntimeError(
            f"optimizer.{name}() while a zero engine trains with this optimizer: the states "
            "live in the engine, partitioned over the ranks. Use engine.save_checkpoint() / "
            "engine.load_checkpoint(); zero.checkpoint.consolidate() turns a checkpoint into "
            "torch state dicts (the optimizer's under 'optimizer'). To resume from a torch "
            "state dict, load it into the optimizer before zero.initialize")
    return refuse


class AttributeRemoval:
    """A handle, like a hook's, that removes an attribute set on an object."""

    def __init__(self, obj, name):
        self._obj, self._name = weakref.ref(obj), name

    def remove(self):
        obj = self._obj()
        if obj is not None:
            obj.__dict__.pop(self._name, None)

"""What the engine sets on the user's optimizer and model objects while it
trains them, since torch has no hook for these calls: zero_grad routed to
the engine (the optimizer's, the model's, each submodule's), the optimizer's
state_dict refused, and the handles that take these attributes away again at
close(). Every route holds its engine weakly."""
from __future__ import annotations

import types
import weakref

from zero.engine._dcp_preparation import undo_dcp_preparation
from zero.engine._optimizer_step_hooks import ENGINE_HOOK


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


def guard_optimizer(engine):
    """optimizer.step() is refused; optimizer.zero_grad() is the
    engine's, so it also drops gradients stages 2-3 reduced already (a
    discarded backward would otherwise still be applied). torch has no
    zero_grad hook: the optimizer object gets an attribute of its own,
    removed by close()."""
    me = weakref.ref(engine)

    def refuse(optimizer, *_args, **_kwargs):
        if me() is not None:  # a dropped engine leaves the optimizer to the user
            dcp = undo_dcp_preparation(optimizer)  # [Note: DCP's preparation]
            if dcp is not None:
                raise RuntimeError(dcp)
            raise RuntimeError("this optimizer is driven by a zero Engine: call "
                               "engine.step(), not optimizer.step()")
    setattr(refuse, ENGINE_HOOK, True)  # engine.step() passes it over ([Note: optimizer step hooks])
    engine._hooks.append(engine.optimizer.register_step_pre_hook(refuse))
    release = getattr(engine.optimizer, "_release_buffers", None)
    if release is not None:
        release()
    engine.optimizer.zero_grad = EngineZeroGrad(engine)
    engine._hooks.append(AttributeRemoval(engine.optimizer, "zero_grad"))
    # its states are the engine's now, partitioned: the optimizer's own
    # state_dict() would hold none (or stale ones), and a load would
    # change nothing the engine uses
    for name in ("state_dict", "load_state_dict"):
        setattr(engine.optimizer, name, refuse_states_call(name))
        engine._hooks.append(AttributeRemoval(engine.optimizer, name))
    # model.zero_grad() too: at stages 2-3 the parameters' .grad are
    # already None after a backward, so torch's alone would drop nothing
    engine.module.zero_grad = types.MethodType(model_zero_grad, engine.module)
    engine._hooks.append(AttributeRemoval(engine.module, "zero_grad"))
    # and a submodule's, which drops its own parameters' gradients: at
    # stages 2-3 they were reduced into the partitions already
    for sub in engine.module.modules():
        if sub is not engine.module and next(sub.parameters(), None) is not None:
            sub.zero_grad = types.MethodType(submodule_zero_grad, sub)
            engine._hooks.append(AttributeRemoval(sub, "zero_grad"))


def on_each_grad(engine, fg, body):
    """body(engine, fg, i) once parameter i of fg has its gradient
    accumulated. The hook holds the engine and fg weakly: torch keeps a
    parameter's hooks where Python's garbage collector does not look, so a
    strong reference would keep a dropped engine, its buffers and its
    offload files until exit."""
    me, group = weakref.ref(engine), weakref.ref(fg)
    for i, p in enumerate(fg.params):
        def hook(_p, i=i):
            target = group()
            if target is not None:
                call_alive(me, body, target, i)
        engine._hooks.append(p.register_post_accumulate_grad_hook(hook))


# [Note: every rank runs every layer] HuggingFace models that skip layers
# at random in training (LayerDrop: wav2vec2's and HuBERT's configs drop a
# tenth of their layers) run every layer on every rank when
# `is_fsdp_managed_module(module)` or DeepSpeed's ZeRO-3 says the parameters
# are gathered by collectives. At stage 3 over several ranks a layer one
# rank skips left the other's gathers unmatched: gloo aborted the process.
# The engine marks the model's modules as FSDP marks those it manages, with
# `_fsdp_use_orig_params` beside it, so that torch.compile treats them as
# FSDP's (parameters not guarded as constants) rather than refusing them;
# HF's generate and Seq2SeqTrainer then turn synced_gpus on by themselves.
# LayerDrop is then off in effect, as under DeepSpeed's ZeRO-3 and FSDP.
# close() takes the marks away; a mark already there (a module FSDP marked
# before) is left alone. A copy or pickle of the model (an EMA twin, a
# torch.save) is a plain model and carries False: as True it made the
# copy's generate() alone on one rank wait in a collective for the others.
# While the model is gathered whole (engine.generate's way: the schedule
# suspended, no collective in a forward) the marks read False too: HF's
# generate synced the ranks by itself there, including an assisted
# decoding's draft model's inner generate, which no synced_gpus=False of
# the caller reaches (the longer rank then waited in its all-reduce).
_IN_STEP_MARKS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


class _WhileTrained:
    """True on the engine's own modules while its forwards gather with
    collectives; False while it is gathered whole, and in a copy or a
    pickle."""
    __slots__ = ("_schedule",)

    def __init__(self, schedule):
        self._schedule = weakref.ref(schedule)

    def __bool__(self):
        schedule = self._schedule()
        return schedule is not None and not schedule.suspended

    def __copy__(self):
        return False

    def __deepcopy__(self, memo):
        return False

    def __reduce__(self):
        return bool, ()


def mark_every_rank_runs_every_layer(engine):
    mark = _WhileTrained(engine._schedule)
    for module in engine.module.modules():
        for name in _IN_STEP_MARKS:
            if name not in module.__dict__:
                module.__dict__[name] = mark
                engine._hooks.append(AttributeRemoval(module, name))

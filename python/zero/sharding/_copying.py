"""What copy.deepcopy, pickle and torch.save make of a model an engine
trains: a plain torch model.

The engine leaves three kinds of things on the user's model: hooks on its
modules, a `_zero_place` on each parameter, and `_zero_engine` on the root.
Copied as they are, a copy's forward ran the original engine's hooks (at
stage 3 a KeyError; at stage 2 its backward fed the original's buckets),
re-initializing a copy closed the original, and pickling failed on the C
buffers or on local functions. So each of them copies and pickles to
nothing: a module hook to a hook that does nothing, the attributes to None.

At stage 3 a released parameter is an empty placeholder, so a copy would
have no weights: the hooks of a module whose parameters are released
refuse to be copied, and say how to copy instead. Inside
zero.GatheredParameters(list(model.parameters())) the copy gets every
value.
"""
from __future__ import annotations

import os
import weakref

import torch


def none():
    """What a pickled attribute of the engine's unpickles to."""
    return None


def noop_hook(*_args, **_kwargs):
    """What a copied or unpickled model has where the engine had a hook."""
    return None


def _noop():
    return noop_hook


class EngineRef:
    """model._zero_engine: the engine that trains the model, held weakly."""
    __slots__ = ("_ref", "__weakref__")

    def __init__(self, engine):
        self._ref = weakref.ref(engine)

    def __call__(self):
        return self._ref()

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (none, ())


_OUTSIDE = []


def _outside_graph():
    """f(*args) run as Python, outside any graph torch.compile makes of the
    module: traced, stage 3's gathers and releases failed inside dynamo.
    Made at the first compilation: torch.compiler.disable imports dynamo,
    a second a process at `import zero` when it decorated the hook."""
    if not _OUTSIDE:
        _OUTSIDE.append(torch.compiler.disable(lambda f, *args, **kwargs: f(*args, **kwargs)))
    return _OUTSIDE[0]


def note_whole_graph_refused(error):
    """torch.compile(..., fullgraph=True) met an engine hook: dynamo's error
    ("function marked as skipped", "disable") named torch, so it gets a note
    naming zero and the way out. The hooks must run as Python between
    graphs (_outside_graph), which a whole graph forbids."""
    if type(error).__module__.startswith("torch._dynamo") and \
            os.path.join("zero", "sharding", "_copying.py") in str(error):
        error.add_note(
            "zero: torch.compile(..., fullgraph=True) cannot take in the engine's module "
            "hooks (stage 2's start of the backward, stage 3's gathers and releases), which "
            "run as Python between graphs. Compile with fullgraph=False (the default), or "
            "train at stage 0-1, whose models compile whole")


class ModuleHook:
    """A module hook of the engine's. `whole()` says whether the module's
    parameters are all there to copy (stage 3: gathered). No __slots__:
    torch marks some hooks with an attribute of its own."""

    def __init__(self, function, whole=None):
        self.function = function
        self.whole = whole

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # traced by dynamo: run it as Python
            return _outside_graph()(self.function, *args, **kwargs)
        return self.function(*args, **kwargs)

    def _check_whole(self):
        if self.whole is not None and not self.whole():
            raise RuntimeError(
                "copying (copy.deepcopy, pickle, torch.save) a model that a zero stage-3 "
                "engine trains: its released parameters are empty placeholders, so the copy "
                "would have no weights. Copy it inside `with "
                "zero.GatheredParameters(list(model.parameters())):`, or load "
                "engine.full_state_dict() into a new model")

    def __deepcopy__(self, memo):
        self._check_whole()
        return noop_hook

    def __reduce__(self):
        self._check_whole()
        return (_noop, ())

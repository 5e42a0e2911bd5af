"""The attributes the engine puts on a user's parameters (`_zero_place`,
`_zero_held_whole`, `_zero_lost`, and DeepSpeed's `ds_*` names at stage 3),
kept out of what the parameter pickles to.

[Note: marks not pickled] torch.save of a parameter itself, not of a state
dict (torch.save(dict(model.named_parameters())), or DeepSpeed-Chat's save,
which calls p.cpu(): on the CPU that is p) pickles the parameter's
__dict__. With the engine's marks in it the file needed zero to load:
torch.load's default weights_only=True refused it (a Place pickles as a
call into zero), and a frozen parameter's weakref could not be pickled at
all. torch pickles a Parameter's state through its __getstate__, which an
attribute of the instance overrides; the first mark puts one there that
leaves the marks out, so the file holds a plain Parameter with the user's
own attributes. (copy.copy goes the same way; copy.deepcopy of a
Parameter copies no attributes.)
"""
from __future__ import annotations

import weakref

from zero.sharding._copying import none

# DeepSpeed's names on a ZeRO-3 parameter (see _ds_attributes.py)
DEEPSPEED_MARKS = frozenset({"ds_id", "ds_status", "ds_numel", "ds_shape", "ds_persist"})
_OWN_PREFIX = "_zero_"


def mark(param, name: str, value) -> None:
    """param.<name> = value, left out of param's pickle."""
    state = param.__dict__
    if not isinstance(state.get("__getstate__"), _StateWithoutMarks):
        state["__getstate__"] = _StateWithoutMarks(param)
    state[name] = value


def unmark(param, name: str) -> None:
    """Take mark `name` off; with the last one, the __getstate__ too."""
    state = param.__dict__
    state.pop(name, None)
    if isinstance(state.get("__getstate__"), _StateWithoutMarks) and \
            not any(is_mark(k) for k in state if k != "__getstate__"):
        del state["__getstate__"]


def is_mark(name: str) -> bool:
    return name.startswith(_OWN_PREFIX) or name in DEEPSPEED_MARKS or name == "__getstate__"


class _StateWithoutMarks:
    """A marked parameter's __getstate__: what its class's __getstate__
    gives (object's: the __dict__; a Parameter subclass may have its own,
    with its own __setstate__), less the marks."""
    __slots__ = ("_param",)

    def __init__(self, param):
        self._param = weakref.ref(param)  # no cycle through the parameter's dict

    def __call__(self):
        param = self._param()
        if param is None:
            return None
        state = type(param).__getstate__(param)
        if isinstance(state, dict):
            return {k: v for k, v in state.items() if not is_mark(k)}
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
            return ({k: v for k, v in state[0].items() if not is_mark(k)}, state[1])
        return state

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):  # pickled inside a dict of the user's (p.__dict__ itself)
        return (none, ())

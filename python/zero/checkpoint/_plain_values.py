"""What a checkpoint may hold: plain values only, so that
torch.load(weights_only=True) reads every file back and no file runs code
(docs/checkpoints.md, "Files are plain"). check_plain refuses
anything else by where it sits; plain_numbers turns the numbers torch and
the script compute for the engine to keep into plain ones."""
from __future__ import annotations

import numbers
from collections import OrderedDict

import torch

PLAIN_TYPES = (str, int, float, bool, type(None), torch.dtype, torch.device)
_DICTS = (dict, OrderedDict)
_SEQUENCES = (list, tuple, torch.Size)


def check_plain(value, where: str, _inside=()):
    """Refuse what torch.load(weights_only=True) could not read back,
    naming where it sits (client_state['a'][2]). _inside: the ids of the
    containers around `value`, to name one that holds itself."""
    kind = type(value)
    if kind in _DICTS or kind in _SEQUENCES:
        if id(value) in _inside:
            raise ValueError(f"{where} is a container that holds itself; a checkpoint keeps "
                             "trees of values only")
        _inside = (*_inside, id(value))
    if kind in _DICTS:
        for k, v in value.items():
            if type(k) not in (str, int, bool):  # weights_only reads these back
                raise TypeError(f"{where} has a key of type {type(k).__name__}; a checkpoint "
                                "keeps str, int and bool keys only (not their subclasses)")
            check_plain(v, f"{where}[{k!r}]", _inside)
    elif kind in _SEQUENCES:
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]", _inside)
    elif isinstance(value, torch.Tensor):
        if kind not in (torch.Tensor, torch.nn.Parameter):
            # weights_only refuses a subclass at load, as code it would run
            raise TypeError(f"{where} is a {kind.__module__}.{kind.__name__}, a tensor "
                            "subclass; a checkpoint keeps plain tensors only (pass "
                            "t.as_subclass(torch.Tensor))")
    elif kind not in PLAIN_TYPES:
        base = next((t for t in kind.__mro__ if t in (*PLAIN_TYPES, dict, list, tuple)), None)
        if base is not None:
            raise TypeError(f"{where} is a {kind.__module__}.{kind.__name__}, a subclass of "
                            f"{base.__name__}; a checkpoint keeps "
                            "the plain types only, which torch.load(weights_only=True) reads "
                            "back (convert it: int(x), str(x), dict(x), list(x))")
        raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__name__}; a "
                        "checkpoint keeps only tensors, numbers, strings, None and lists or "
                        "dicts of them (so it loads with torch.load(weights_only=True))")


def plain_numbers(value):
    """value with every number of a non-plain type (numpy's float64, a
    float subclass; its float32 or int64) made the plain float or int of
    the same value, in dicts, lists and tuples alike. For what torch and
    the script compute for the engine to keep (the param groups' learning
    rates, a scheduler's state): a LambdaLR written with np.cos made every
    lr a numpy.float64, and the first save_checkpoint, hours in, refused it."""
    kind = type(value)
    if kind in _DICTS:
        return kind((k, plain_numbers(v)) for k, v in value.items())
    if kind in (list, tuple):
        return kind(plain_numbers(v) for v in value)
    if kind in PLAIN_TYPES or isinstance(value, (bool, torch.Tensor)) or \
            not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)

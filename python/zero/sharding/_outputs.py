"""The tensors inside what a module returns or takes: nested tuples, lists,
dicts and namedtuples (torch's pytree), and plain dataclasses, which
pytree treats as opaque leaves but models return (an output record with
`loss` and `logits` fields), so a hook looking only at pytree's leaves
would miss every tensor inside one. And a hook for when all of them have
their gradients."""
from __future__ import annotations

import copy
import dataclasses
import threading

import torch
from torch.utils._pytree import tree_flatten, tree_map


def _is_dataclass_instance(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def tensors_in(value) -> list:
    """Every tensor in `value`, depth first."""
    if isinstance(value, torch.Tensor):
        return [value]  # a block's usual output: pytree's walk costs 3 us
    out = []
    for leaf in tree_flatten(value)[0]:
        if torch.is_tensor(leaf):
            out.append(leaf)
        elif _is_dataclass_instance(leaf):
            out.extend(tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return out


def map_tensors(fn, value):
    """`value` with each tensor t replaced by fn(t) (a dataclass is copied
    only where one of its tensors changed)."""
    def visit(leaf):
        if torch.is_tensor(leaf):
            return fn(leaf)
        if not _is_dataclass_instance(leaf):
            return leaf
        changes = {}
        for f in dataclasses.fields(leaf):
            old = getattr(leaf, f.name)
            new = map_tensors(fn, old)
            if new is not old:
                changes[f.name] = new
        if not changes:
            return leaf
        # a shallow copy with the fields set directly: replace() would run
        # __init__/__post_init__ and cannot set init=False fields
        duplicate = copy.copy(leaf)
        for name, new in changes.items():
            object.__setattr__(duplicate, name, new)
        return duplicate
    return tree_map(visit, value)


def detach_from_units(units, output):
    """Copies of the outputs that are views of a stage-3 unit about to be
    released (a module returning self.weight[:n]): the release frees that
    storage. The copy keeps the autograd graph."""
    freed = {(u.full.device, u.full.untyped_storage().data_ptr()) for u in units
             if u.gathered and not u.persistent and u.active == 0}
    if not freed:
        return output

    def copy_if_view(t):
        if torch.is_tensor(t) and not t.is_meta and \
                (t.device, t.untyped_storage().data_ptr()) in freed:
            return t.clone()
        return t
    if isinstance(output, torch.Tensor):
        return copy_if_view(output)  # a block's usual output: no pytree walk
    return map_tensors(copy_if_view, output)


def node_key(tensor):
    """A non-leaf tensor's place in the autograd graph: its node's id and
    which of the node's outputs it is. Not the node itself: the key lives
    in a hook that autograd keeps on that node, and a node that holds
    itself through its own hook is a cycle through C++ that Python's
    collector never frees (every graph of a forward without a backward
    stayed, with its activations, and kept the engine alive after close()).
    Ids are looked up while the graph lives; Stage3Schedule.release_with
    empties each pass."""
    return id(tensor.grad_fn), tensor.output_nr


def after_every_gradient(tensors, fn):
    """fn() once a backward has computed the gradients of all `tensors`:
    register_multi_grad_hook(mode="all")'s work, without its closures
    holding the tensors' autograd nodes, which hold the closures (a cycle
    through C++ that Python's collector never frees: stage 3's frozen
    units under PEFT's adapters left a graph behind every step, +27 MiB
    over 600 steps of a tiny Llama). A backward that computes only some of
    them (backward(inputs=...)) leaves fn uncalled; the end of the backward
    does its work then."""
    lock, seen = threading.Lock(), [None, 0]  # the backward's id, gradients seen in it
    expected = len(tensors)  # the closure must not hold `tensors` (their nodes hold it)

    def hook(_grad):
        task = torch._C._current_graph_task_id()
        with lock:
            if seen[0] != task:
                seen[0], seen[1] = task, 0
            seen[1] += 1
            done = seen[1] == expected
        if done:
            fn()
    for t in tensors:
        t.register_hook(hook)


def in_function_transform() -> bool:
    """Whether a torch.func transform (grad, vmap, jacrev) is running: its
    backward computes gradients of what it was given, into no parameter's
    .grad, so the engine takes no part in it."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None

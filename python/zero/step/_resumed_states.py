"""States an optimizer already holds when zero.initialize takes it over: a
torch run resumed with optimizer.load_state_dict(...) before initialize;
and, at close(), the engine's states given back to the optimizer.

They are in parameter space (one tensor per parameter, torch's names), as
in a torch state dict, so each rank copies its partition's slice of them
into the engine's states, and the group's step count from theirs. The
optimizer's own copies are then dropped (they would hold a second full
copy of the states). What the engine cannot represent is refused by name:
parameters of one group at different step counts (the engine keeps one
count per group) or some with states and some without.
"""
from __future__ import annotations

import torch


def held_optimizer_states(optimizer, groups) -> dict:
    """The states the optimizer holds, by its state_dict's parameter
    numbers, checked before the model is changed (an empty dict: none).
    Read here, once: zero.optim's state_dict() syncs its flat buffers with
    the parameters, which after initialize are the engine's. An entry at
    step 0 is a fresh one (zero.optim, torch's Adagrad make them at
    construction). groups: (params, names) per optimizer param group."""
    left = optimizer.__dict__.get("_zero_states_left_behind")
    if left is not None:
        raise ValueError(left.message)
    saved = {i: entry for i, entry in optimizer.state_dict()["state"].items()
             if entry and float(entry.get("step", 1)) > 0}
    if saved:
        index_of = _index_of(optimizer)
        for index, (params, names) in enumerate(groups):
            _held(saved, index_of, index, params, names)
    return saved


def describe_held(saved) -> str:
    """What held_optimizer_states found, as the ranks compare it: which
    parameters have states, at which step."""
    return " ".join(f"{i}:{float(entry.get('step', -1))}" for i, entry in sorted(saved.items()))


def take_in_optimizer_states(optimizer, groups, saved) -> None:
    """groups: the engine's trainable FlatGroups (their states allocated);
    saved: held_optimizer_states' answer. The optimizer's own entries
    go in every case: fresh ones too (torch's Adagrad fills a sum for each
    parameter at construction), which held a whole fp32 copy of the model
    on every rank, 4Ψ bytes no figure counted, beside the engine's states."""
    if not saved:
        optimizer.state.clear()
        return
    index_of = _index_of(optimizer)
    for fg in groups:
        held = _held(saved, index_of, fg.index, fg.params, fg.names)
        if held is None:
            continue
        fg.step_count = _agreed_step(fg.index, held)
        for name, target in fg.states.items():
            if all(s.get(name) is not None for s in held):
                _copy_partition(fg, target, [s[name] for s in held])
        fg.release_offloaded()
    optimizer.state.clear()


def _index_of(optimizer) -> dict:
    """id(parameter) -> its number in the optimizer's state_dict (counted
    over the param groups in order)."""
    return {id(p): i for i, p in enumerate(p for group in optimizer.param_groups
                                          for p in group["params"])}


def _held(saved, index_of, index, params, names):
    """The saved states of one group's parameters, in order; None when it
    has none. Raises for what one step count per group cannot hold."""
    held = [saved.get(index_of[id(p)]) for p in params]
    if not any(held):
        return None
    missing = [names[j] for j, s in enumerate(held) if not s]
    if missing:
        raise ValueError(
            f"optimizer param group {index}: the optimizer holds states for some of its "
            f"parameters but not for {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''}; zero keeps one step count per group and "
            "cannot start those afresh. Load a state dict that covers them all, or none (a "
            "fresh optimizer)")
    _agreed_step(index, held)
    return held


def _agreed_step(index, held) -> int:
    steps = {int(float(s["step"])) for s in held if "step" in s}
    if len(steps) > 1:
        raise ValueError(
            f"optimizer param group {index}: its parameters' states are at different step "
            f"counts ({sorted(steps)}); zero keeps one step count per group. Start them "
            "together, or put them in separate param groups")
    if steps:
        return steps.pop()
    # torch's SGD counts no steps; a momentum buffer means it has stepped
    return 1


def _copy_partition(fg, target, values):
    """This rank's partition of the per-parameter tensors `values`, laid
    out as the group lays out its parameters, into `target`."""
    full = torch.zeros(fg.layout_size, dtype=torch.float32)
    for j, value in enumerate(values):
        view = fg.view(full, j)
        if not torch.is_tensor(value) or value.shape != view.shape:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"optimizer state of parameter '{fg.names[j]}' has shape {shape}; "
                             f"the parameter's is {tuple(view.shape)}")
        view.copy_(value)
    for unit in fg.units:
        layout = full[unit.layout_offset:unit.layout_offset + unit.total]
        target[unit.shard_slice].copy_(unit.chunk(layout, fg.owner))


def give_back_optimizer_states(optimizer, groups, world) -> None:
    """Engine.close(): the optimizer gets its states back in parameter space
    (and each param group its step count), so a plain torch run, or a new
    initialize with the same optimizer (a re-run notebook cell), goes on
    from them. At one rank a partition is the whole group; at several,
    each rank holds a slice, and gathering the whole states on every rank
    could need more memory than the run had: they are not given back, and
    what would start them afresh is refused (_StatesLeftBehind).

    [Note: states given back] States in memory are given as tensors of their
    own. States in offload files come back as views of the files' mappings,
    so close() needs no memory for them whatever their size: a page is read
    in when the optimizer (or anything else) reads it, and the files' space
    returns when the last view is freed. Writing into them (torch's step)
    dirties pages of the mapping, which the kernel writes back to the file."""
    stepped = [fg for fg in groups if fg.step_count > 0]
    if not stepped:
        return
    if world > 1:
        _StatesLeftBehind(optimizer)
        return
    counts_steps = not isinstance(optimizer, torch.optim.SGD)  # torch's SGD keeps none
    # zero.optim's lay the states out anew in their own fp32 buffers; torch's
    # keep them in the parameter's dtype, which close() gave back ([Note:
    # dtypes given back] in engine/_handback.py): a bfloat16 model's are cast
    own_layout = hasattr(optimizer, "_resume_after_engine")
    for fg in stepped:
        # states in files (offload_optimizer "nvme") are given as views of
        # the mapped files: they may not fit in memory, and a view is
        # resident only where it is read ([Note: states given back])
        in_files = fg.offload is not None
        for i, p in enumerate(fg.params):
            entry = {}
            for name, t in fg.states.items():
                value = fg.view(t, i)
                if value.dtype != p.dtype and not own_layout:
                    entry[name] = value.to(p.dtype)
                else:
                    entry[name] = value if in_files else value.clone()
            if own_layout and fg.master is not fg.shard and p.dtype != fg.master.dtype:
                entry["master_param"] = fg.view(fg.master, i).clone()
            if counts_steps:
                entry["step"] = torch.tensor(float(fg.step_count))
            optimizer.state[p] = entry
        fg.release_offloaded()


class _StatesLeftBehind:
    """close() at several ranks: the optimizer holds no states now, so what
    would silently start them afresh is refused until it gets states again
    (its load_state_dict): step(), state_dict() and a new zero.initialize.
    A warning at every close() was noise for the usual end of a run, which
    uses the optimizer no more."""

    message = (
        "this optimizer's states stayed partitioned over the ranks of the zero engine that "
        "was closed (gathering them whole on every rank could need more memory than the run "
        "had), so it holds none: its step(), state_dict() and a new zero.initialize would "
        "start them afresh. Save them with engine.save_checkpoint() before close() and load "
        "them into a new engine with a new optimizer (engine.load_checkpoint), or as torch "
        "state dicts "
        "(zero.checkpoint.consolidate) with optimizer.load_state_dict(), which lifts this")

    def __init__(self, optimizer):
        self._hook = optimizer.register_step_pre_hook(self._refuse)
        own = optimizer.__dict__
        own["_zero_states_left_behind"] = self
        own["state_dict"] = self._refuse
        own["load_state_dict"] = lambda state_dict: self._load(optimizer, state_dict)

    def _refuse(self, *_args, **_kwargs):
        raise RuntimeError(self.message)

    def _load(self, optimizer, state_dict):
        type(optimizer).load_state_dict(optimizer, state_dict)
        self._hook.remove()
        for name in ("_zero_states_left_behind", "state_dict", "load_state_dict"):
            optimizer.__dict__.pop(name, None)

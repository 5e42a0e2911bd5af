"""engine.load_checkpoint: any world size, stage and tp size reads back
what save_checkpoint (_engine_save.py) wrote, every stretch checked before
anything changes. The layout is in checkpoint/_format.py ([Note:
checkpoint layout]).

A collective: every rank calls it with the same arguments, and every rank
must be able to read every file (a shared filesystem across machines).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from zero._warnings import warn_user
from zero.config._values import require_bool
from zero._progress import bar
from zero.checkpoint._engine_parts import (all_ok, checkpoint_name, holds_a_part, in_files,
                                           param_shapes, release_offloaded, replicated_frozen,
                                           whole_comm)
from zero.checkpoint._client_states import client_state_for
from zero.checkpoint._extra_states import extra_state_modules, owner_name, set_extra_states
from zero.checkpoint._format import (LATEST_FILE, META_FILE, STAGING_SUFFIX, CheckpointReader,
                                     resolve_tag, tag_directory_hint)
from zero.checkpoint._restored_settings import check_restored_settings
from zero.sharding._groups_together import refresh_params
from zero.sharding._param_writes import bump_versions
from zero.sharding._step_agreement import agree, agree_on_call
from zero.sharding._units import parameter_names, uncompiled
from zero.step._registry import fresh_states


def _nothing_to_load(engine, load_dir, tag, flags: str) -> bool:
    """No tag asked for, and the directory holds no checkpoint at all (it is
    missing, or has neither `latest` nor a tag directory): the "resume if
    there is one" start of a run, which DeepSpeed answers with (None, None).
    Agreed over the ranks: with node-local disks, one rank may see one.
    flags: the load's arguments that decide what it loads, compared over
    the ranks with the call (load_optimizer_states=False on one rank alone
    restarted that rank's slice of the optimizer, silently)."""
    try:
        save_dir = os.fspath(load_dir)
    except TypeError:
        return False  # the load's own checks name the argument
    # a file, or "", is a mistake for the load's checks to name, not a
    # first start (a weights file given as the directory would train afresh)
    empty = tag is None and save_dir != "" and \
        not os.path.exists(os.path.join(save_dir, LATEST_FILE)) and \
        (not os.path.exists(save_dir) or
         (os.path.isdir(save_dir) and not _holds_a_tag(save_dir)))
    whole = whole_comm(engine)
    others = agree_on_call(whole, engine.call_text(f"load_checkpoint({flags})"), refused=empty)
    if others != (whole.world - 1 if empty else 0):
        raise RuntimeError(
            f"load_checkpoint: {save_dir!r} holds a checkpoint on some ranks and none on "
            "others (node-local disks?); give every rank the same checkpoint directory")
    return empty


def _holds_a_tag(save_dir) -> bool:
    """Whether save_dir is a tag directory or holds one (a checkpoint,
    whichever its tag)."""
    if tag_directory_hint(save_dir):
        return True
    try:
        with os.scandir(save_dir) as entries:
            # a killed first save's staging directory is no checkpoint
            return any(e.is_dir() and os.path.isfile(os.path.join(e.path, META_FILE)) and
                       not e.name.endswith(STAGING_SUFFIX) for e in entries)
    except OSError:
        return True  # unreadable: not "empty"; the load's own checks say why


def _check_params(engine, meta):
    saved = meta["params"]
    ours = param_shapes(engine)
    missing = [n for n in ours if n not in saved]
    # a pipeline stage holds a part of the model the checkpoint holds
    extra = [] if holds_a_part(engine) else [n for n in saved if n not in ours]
    if missing:
        raise ValueError(f"the checkpoint has no parameter {missing[0]!r}"
                         + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
                         + "; was it saved from another model?")
    if extra:
        raise ValueError(f"the checkpoint's parameter {extra[0]!r} is not in the model"
                         + (f" (nor {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for name, (shape, _trainable) in ours.items():
        if list(shape) != list(saved[name]["shape"]):
            raise ValueError(f"parameter '{name}' has shape {tuple(shape)} in the model but "
                             f"{tuple(saved[name]['shape'])} in the checkpoint")


def _check_optimizer(engine, reader):
    meta = reader.meta
    hint = "; pass load_optimizer_states=False to load the weights and start the optimizer afresh"
    if meta["optimizer"] != engine._spec.name:
        raise ValueError(f"the checkpoint holds {meta['optimizer_class']} states, the engine's "
                         f"optimizer is {type(engine.optimizer).__qualname__}" + hint)
    groups = engine.optimizer.param_groups
    if len(meta["groups"]) != len(groups):
        raise ValueError(f"the checkpoint has {len(meta['groups'])} param groups, the "
                         f"optimizer has {len(groups)}" + hint)
    names = parameter_names(engine.module)
    part = holds_a_part(engine)
    for gi, (saved, group) in enumerate(zip(meta["groups"], groups)):
        ours = [checkpoint_name(engine, names[id(p)]) for p in group["params"]]
        if (not set(ours) <= set(saved["param_names"])) if part else \
                sorted(ours) != sorted(saved["param_names"]):
            only_here = sorted(set(ours) - set(saved["param_names"]))
            only_saved = sorted(set(saved["param_names"]) - set(ours))
            what = "; ".join(f"{label}: {', '.join(repr(n) for n in found[:3])}"
                             f"{' ...' if len(found) > 3 else ''}"
                             for label, found in (("only in the optimizer", only_here),
                                                  ("only in the checkpoint", only_saved))
                             if found) or "the same names, another count"
            raise ValueError(f"param group {gi} holds other parameters than in the "
                             f"checkpoint ({what})" + hint)
    fresh = never_trained(engine, meta)
    for fg in engine.groups:
        if fg.index in fresh:
            continue  # no states to read: they start afresh
        # the saved hyperparameters replace the optimizer's: the engine
        # must keep the states they ask for (amsgrad, momentum); it may
        # keep more (saved during a momentum warm-up at 0: the buffer is
        # in the checkpoint, and used again when the momentum comes back)
        saved_states = set(engine._spec.states(meta["groups"][fg.index]["hyper"]))
        if not saved_states <= set(fg.states):
            raise ValueError(f"param group {fg.index} was saved with hyperparameters that keep "
                             f"the states {sorted(saved_states)}, the engine's optimizer keeps "
                             f"{sorted(fg.states)} (amsgrad or momentum differ)" + hint)
        for name in map(lambda n: checkpoint_name(engine, n), fg.names):
            for key in fg.states:
                if not reader.has_state(name, key):
                    raise ValueError(f"the checkpoint has no optimizer state {key!r} for "
                                     f"parameter '{name}'" + hint)


def never_trained(engine, meta) -> set:
    """The indices of the engine's param groups that the saving engine
    never trained: every parameter of the group was frozen then (progressive
    unfreezing), so it saved no states and counted no step. Their states
    start afresh on load, as torch's optimizer starts a parameter it holds
    no state for; a group saved with states or steps is read as saved."""
    return {fg.index for fg in engine.groups
            if "states" in meta["groups"][fg.index] and not meta["groups"][fg.index]["states"]
            and meta["groups"][fg.index]["step"] == 0}


def _targets(engine, with_optimizer, fresh=()):
    """(flat group, name, lo, hi, offset, keys): what this rank reads;
    name is the parameter's own (checkpoint_name gives where it is kept).
    fresh: the groups whose states are not read (never_trained)."""
    for fg in engine.all_groups:
        keys = ["value"] + (list(fg.states) if with_optimizer and fg.trainable and
                            fg.index not in fresh else [])
        for name, lo, hi, offset in fg.owned_pieces():
            yield fg, name, lo, hi, offset, keys


def _check_stored(engine, reader, with_optimizer):
    """Every stretch this rank will read is in the files: checked before
    anything is overwritten, so a damaged checkpoint leaves the engine as
    it was. (A tensor-parallel piece is read from its whole tensor.)"""
    tp = engine._tensor_parallel
    whole = set()
    fresh = never_trained(engine, reader.meta) if with_optimizer else ()
    for _fg, name, lo, hi, _offset, keys in _targets(engine, with_optimizer, fresh):
        for key in keys:
            if tp is not None and tp.is_sharded(name):
                whole.add((checkpoint_name(engine, name), key))
            else:
                reader.check(checkpoint_name(engine, name), key, lo, hi - lo)
    for name, p in replicated_frozen(engine):
        if tp is not None and tp.is_sharded(name):
            whole.add((checkpoint_name(engine, name), "value"))
        else:
            reader.check(checkpoint_name(engine, name), "value", 0, p.numel())
    for name, key in sorted(whole):
        reader.check(name, key, 0, reader.meta["params"][name]["numel"])


class _LocalPieces:
    """Reads a rank's elements of its parameters from the checkpoint, each
    from the name it is kept under (a pipeline stage's tied copy: the
    parameter's). A tensor-parallel rank's local elements come from the
    whole tensors: each whole tensor is read once, and its local piece
    kept until another is asked for (a piece of a Shard(1) weight is one
    stretch per row of the whole)."""

    def __init__(self, engine, reader):
        self.engine = engine
        self.tp = engine._tensor_parallel
        self.reader = reader
        self.held = (None, None)

    def local(self, name, key) -> torch.Tensor:
        if self.held[0] != (name, key):
            whole = self.reader.read(checkpoint_name(self.engine, name), key)
            self.held = ((name, key), self.tp.placement(name).local_slice(
                whole, self.tp.rank).reshape(-1))
        return self.held[1]

    def read_into(self, name, key, lo, out):
        if self.tp is None or not self.tp.is_sharded(name):
            self.reader.read_into(checkpoint_name(self.engine, name), key, lo, out)
        else:
            out.copy_(self.local(name, key)[lo:lo + out.numel()])


_COPY_CHUNK = 1 << 22  # elements a load copies between two drops of a file's pages


def _load_partitions(engine, reader, with_optimizer):
    try:
        _read_partitions(engine, reader, with_optimizer)
    finally:  # offloaded states were written through their mapping
        release_offloaded(engine)


def _drop_read_pages(reader, mappings, touched: dict):
    """A model on a disk: the pages the copies since the last call read
    (the checkpoint's) and wrote (the groups' files) leave memory."""
    for fg in touched.values():
        fg.release_offloaded()
    touched.clear()
    reader.drop_pages(mappings)


def _read_partitions(engine, reader, with_optimizer):
    for fg in engine.all_groups:
        fg.check_shard_writable()
        fg.settle_copies()
    # a model on a disk: the copies' pages (the checkpoint's and the
    # files') are dropped every _COPY_CHUNK elements, so loading holds
    # about that much of them, or one key of one parameter's piece where
    # that is larger (read_into copies a piece whole)
    on_disk = in_files(engine)
    mappings = reader.file_mappings() if on_disk else None
    pieces = _LocalPieces(engine, reader)
    fresh = never_trained(engine, reader.meta) if with_optimizer else ()
    targets = list(_targets(engine, with_optimizer, fresh))
    nbytes = sum(4 * (hi - lo) * len(keys) for _fg, _n, lo, hi, _o, keys in targets)
    with bar("loading checkpoint (rank 0's part)", total=nbytes,
             enabled=whole_comm(engine).rank == 0) as progress:
        # pages dropped every _COPY_CHUNK elements, not after every
        # parameter's key: each drop walks every group and shard tensor, so
        # 8,000 small parameters took 53 s to load (0.16 s to save)
        read, touched = 0, {}
        for fg, name, lo, hi, offset, keys in targets:
            for key in keys:
                target = fg.states[key] if key != "value" else \
                    fg.master if fg.trainable else fg.shard
                pieces.read_into(name, key, lo, target[offset:offset + hi - lo])
                progress.update(4 * (hi - lo))
                if on_disk:
                    read += hi - lo
                    touched[id(fg)] = fg
                    if read >= _COPY_CHUNK:
                        _drop_read_pages(reader, mappings, touched)
                        read = 0
        if on_disk:
            _drop_read_pages(reader, mappings, touched)
    for fg in engine.all_groups:
        if fg.trainable and fg.master is not fg.shard:
            # the parameters: the master rounded, a chunk at a time
            for lo in range(0, fg.part_size, _COPY_CHUNK):
                hi = min(lo + _COPY_CHUNK, fg.part_size)
                fg.shard[lo:hi].copy_(fg.master[lo:hi])
                if on_disk:
                    fg.release_offloaded()
    refresh_params(engine.all_groups)  # the small groups together
    with torch.no_grad():
        for name, p in replicated_frozen(engine):
            value = torch.empty(p.numel(), dtype=torch.float32)
            pieces.read_into(name, "value", 0, value)
            p.copy_(value.view(p.shape))


def _reset_optimizer(engine, only=None):
    """load_optimizer_states=False: the optimizer starts afresh on the
    loaded weights, as one just built would. only: these groups' indices
    (never_trained's), not every group."""
    for fg in engine.groups:
        if only is not None and fg.index not in only:
            continue
        fills = fresh_states(engine.optimizer, engine._spec,
                             engine.optimizer.param_groups[fg.index])
        for name, t in fg.states.items():
            # a state the group's settings no longer ask for (momentum set
            # to 0 since initialize) is kept, and starts from zero too
            t.fill_(fills.get(name, 0.0))
        fg.step_count = 0
    release_offloaded(engine)


def _buffer_items(engine):
    names = parameter_names(engine.module)
    extra = _extra_states_of(engine)
    return [(k, t) for k, t in engine.module_state_entries().items()
            if id(t) not in names and k not in extra]


def _extra_states_of(engine) -> dict:
    return extra_state_modules(uncompiled(engine.module))  # [Note: extra state]


def _saved_extra_states(engine, meta) -> dict:
    """{key: saved extra state} for the model's modules that keep one; a
    checkpoint of before [Note: extra state] kept a tensor one among the
    buffers. Raises for one the checkpoint lacks."""
    saved = {}
    for key, module in _extra_states_of(engine).items():
        if getattr(type(module), "set_extra_state", None) is nn.Module.set_extra_state:
            raise ValueError(f"module {owner_name(key)!r} "
                             f"({type(module).__name__}) defines get_extra_state but not "
                             "set_extra_state, so no extra state can be given back to it "
                             "(torch's load_state_dict refuses its key too)")
        if key in meta.get("extra_states", {}):
            saved[key] = meta["extra_states"][key]
        elif key in meta["buffers"]:
            saved[key] = meta["buffers"][key]
        elif not holds_a_part(engine):
            raise ValueError(f"the checkpoint has no extra state {key!r} (the model's "
                             f"{type(module).__name__} keeps one: "
                             "get_extra_state)")
    return saved


def _check_buffers(engine, meta):
    """The same buffers, by name and shape, as the parameters are checked:
    a saved buffer the model lacks means another model."""
    ours = dict(_buffer_items(engine))
    _saved_extra_states(engine, meta)
    kept = set(ours) | set(_extra_states_of(engine))
    extra = [] if holds_a_part(engine) else [key for key in meta["buffers"] if key not in kept]
    if extra:
        raise ValueError(f"the checkpoint's buffer {extra[0]!r} is not in the model"
                         + (f" (nor {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for key, t in ours.items():
        saved = meta["buffers"].get(key)
        if saved is None:
            raise ValueError(f"the checkpoint has no buffer {key!r}")
        if saved.shape != t.shape:
            raise ValueError(f"buffer {key!r} has shape {tuple(t.shape)} in the model but "
                             f"{tuple(saved.shape)} in the checkpoint")
        # floats of any width load into floats (a run's precision may
        # differ); anything else is another model's buffer
        if saved.dtype != t.dtype and not (saved.is_floating_point() and t.is_floating_point()):
            raise ValueError(f"buffer {key!r} has dtype {t.dtype} in the model but "
                             f"{saved.dtype} in the checkpoint")


def _load_buffers(engine, meta):
    with torch.no_grad():
        for key, t in _buffer_items(engine):
            t.copy_(meta["buffers"][key])
    saved = _saved_extra_states(engine, meta)
    set_extra_states({k: m for k, m in _extra_states_of(engine).items() if k in saved}, saved)


def _same_checkpoint_everywhere(engine, path, meta):
    """Each rank resolves its own tag (its argument, or `latest` as it
    reads it) and loads its partitions from there: ranks given other tags
    each took theirs, one model made of two checkpoints, silently. The tag
    and the save's id (one per save, agreed by its ranks) are compared
    here, before anything changes; copies of one checkpoint on node-local
    disks agree."""
    tag = os.path.basename(os.path.normpath(path))
    verdict = agree(whole_comm(engine), f"checkpoint {tag} of save {meta.get('save_id')}",
                    0, 0, False)
    if not verdict.same_call:
        raise ValueError(f"load_checkpoint: the ranks resolved different checkpoints (this "
                         f"rank: {path!r}); give every rank the same tag, or the same "
                         "'latest'. Nothing was loaded")


def at_a_boundary(micro_steps: int, accumulation: int) -> int:
    """micro_steps rounded up to a multiple of `accumulation`: the next
    micro-step starts an accumulation window of that count."""
    return -(-micro_steps // accumulation) * accumulation


def set_counts(engine, micro_steps, global_steps, skipped_steps):
    """The engine's counters from a save (or a closed engine): saved at a
    boundary, the next micro-step starts an accumulation window also when
    this engine accumulates over another count (a global batch kept at
    another world size)."""
    engine.micro_steps = at_a_boundary(micro_steps, engine.config.gradient_accumulation_steps)
    engine.global_steps = global_steps
    engine.skipped_steps = skipped_steps


def take_schedule_lrs(engine):
    """Each param group at the learning rate its restored schedule says."""
    for group, lr in zip(engine.optimizer.param_groups,
                         getattr(engine.lr_scheduler, "_last_lr", None) or []):
        group["lr"] = lr


def load(engine, load_dir, tag=None, load_optimizer_states=True,
         load_lr_scheduler_states=True, load_module_only=False):
    flags = f"load_optimizer_states={load_optimizer_states!r}, " \
        f"load_lr_scheduler_states={load_lr_scheduler_states!r}, " \
        f"load_module_only={load_module_only!r}"
    if _nothing_to_load(engine, load_dir, tag, flags):
        warn_user(f"load_checkpoint: {os.fspath(load_dir)!r} holds no checkpoint yet; "
                  "nothing was loaded (returned None, None, as DeepSpeed does)", RuntimeWarning)
        return None, None
    with_optimizer = load_optimizer_states and not load_module_only
    error = None
    try:
        for name, flag in (("load_optimizer_states", load_optimizer_states),
                           ("load_lr_scheduler_states", load_lr_scheduler_states),
                           ("load_module_only", load_module_only)):
            require_bool(flag, name)  # by truth, "no" loaded the optimizer
        path = resolve_tag(load_dir, tag)
        reader = CheckpointReader(path)
        meta = reader.meta
        _check_params(engine, meta)
        if with_optimizer:
            _check_optimizer(engine, reader)
        _check_stored(engine, reader, with_optimizer)
        _check_buffers(engine, meta)
        check_restored_settings(engine, meta, with_optimizer, load_module_only,
                                load_lr_scheduler_states)
        whole = whole_comm(engine)
        client_state, client_warning = client_state_for(reader, whole.rank, whole.world)
    except Exception as e:  # raised on every rank, before anything changes
        error = e
    all_ok(engine, error, "loading")
    _same_checkpoint_everywhere(engine, path, meta)
    engine.zero_grad()
    if engine._delayed is not None:  # its states and parameters are replaced now
        engine._delayed.drop()
    _load_partitions(engine, reader, with_optimizer)
    for fg in engine.all_groups:
        # the loaded values replace any write since the last step, and a
        # graph built before the load must not be backpropagated after it
        bump_versions(fg)
    _load_buffers(engine, meta)
    if with_optimizer:
        for group, saved in zip(engine.optimizer.param_groups, meta["groups"]):
            group.update(saved["hyper"])
        for fg in engine.groups:
            fg.step_count = meta["groups"][fg.index]["step"]
        fresh = never_trained(engine, meta)
        if fresh:
            _reset_optimizer(engine, only=fresh)
    elif not load_module_only:
        _reset_optimizer(engine)
    if not load_module_only:
        # checkpoints written before skipped_steps was recorded: none known
        set_counts(engine, meta["engine"]["micro_steps"], meta["engine"]["global_steps"],
                   meta["engine"].get("skipped_steps", 0))
        if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(meta["loss_scaler"])
        if load_lr_scheduler_states and engine.lr_scheduler is not None and \
                meta["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
            if not with_optimizer:
                # the optimizer starts afresh: at the schedule's current lr.
                # Loaded, its groups keep their saved lr, as torch's resume
                # from both state dicts keeps it (a rate set by hand since
                # the schedule's last step, on a plateau, was replaced by
                # the schedule's: one update at another lr, and a StepLR,
                # which multiplies the group's lr, lost it for good)
                take_schedule_lrs(engine)
    if client_warning is not None and whole.rank == 0:
        warn_user(client_warning, RuntimeWarning)
    return path, client_state

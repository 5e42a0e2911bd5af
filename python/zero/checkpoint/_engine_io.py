"""engine.save_checkpoint and engine.load_checkpoint: each rank writes its
own partitions; any world size and any stage reads them back. The layout
is in checkpoint/_format.py ([Note: checkpoint layout]).

Both are collectives: every rank calls them with the same arguments, and
every rank must be able to read every file (a shared filesystem across
machines).
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch

from zero._version import __version__
from zero.checkpoint._format import (FORMAT, LATEST_FILE, META_FILE, REPLICATED_GROUP,
                                     STAGING_SUFFIX, VERSION, CheckpointReader, check_plain, check_tag,
                                     owned_pieces, resolve_tag, shard_file,
                                     staging_directory, tag_directory_hint)
from zero.checkpoint._writes import (discard_replaced, discard_staging, prepare_staging, publish,
                                     write_file, write_latest)
from zero.sharding._units import parameter_names
from zero.step._registry import fresh_states
from zero.offload._mapped import PagesDroppedMeanwhile
from zero.sharding._param_writes import bump_versions, take_in_parameter_writes
from zero.checkpoint._restored_settings import check_restored_settings
from zero.sharding._step_agreement import agree_on_call


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """t for torch.save: as it is when it is a whole host storage (states,
    stage-3 shards, a bf16 master), else copied, since torch.save writes a
    view's whole storage (at fp32 stages 0-2 the master is a chunk of the
    gathered parameters)."""
    t = t.detach()
    whole = t.device.type == "cpu" and t.storage_offset() == 0 and t.is_contiguous() and \
        t.untyped_storage().nbytes() == t.nbytes
    return t if whole else t.to("cpu", copy=True)


def _replicated_frozen(engine) -> list:
    """(name, parameter) for the frozen parameters that no flat group holds
    (stages 0-2 keep them whole on every rank)."""
    grouped = {id(p) for fg in engine.all_groups for p in fg.params}
    out, seen = [], set()
    for name, p in engine.module.named_parameters():
        if id(p) not in grouped and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _shard_groups(engine) -> list:
    """This rank's part of the checkpoint: for each flat group it holds a
    partition of, the partition tensors and their pieces."""
    rank = engine._comm.rank
    replicate = engine._comm.replicate
    if replicate is not None and replicate.rank != 0:
        return []  # a replica of partitions its replicate rank 0 writes
    groups = []
    for fg in engine.all_groups:
        if fg.num_partitions == 1 and rank != 0:
            continue  # stage 0: every rank holds the same; rank 0 writes it
        if fg.trainable:
            tensors = {"value": _host_copy(fg.master)}
            tensors.update({k: _host_copy(t) for k, t in fg.states.items()})
        else:
            tensors = {"value": _host_copy(fg.shard)}
        groups.append({"index": fg.index, "tensors": tensors, "pieces": owned_pieces(fg)})
    frozen = _replicated_frozen(engine)
    if frozen and rank == 0:
        pieces, offset = [], 0
        for name, p in frozen:
            pieces.append((name, 0, p.numel(), offset))
            offset += p.numel()
        value = torch.cat([_as_fp32_exactly(name, p) for name, p in frozen])
        groups.append({"index": REPLICATED_GROUP, "tensors": {"value": value},
                       "pieces": pieces})
    return groups


def _as_fp32_exactly(name, p) -> torch.Tensor:
    """A frozen parameter's values in fp32, as the checkpoint keeps them;
    refused when fp32 cannot hold them exactly (an int64 past 2**24, a
    complex one's imaginary part), which the load would otherwise give
    back changed, without a word. (Floating ones are in the engine's
    compute dtype since initialize, which fp32 holds.)"""
    flat = p.detach().reshape(-1).to("cpu")
    if flat.is_complex():
        exact = not bool(flat.imag.any()) and \
            torch.equal(flat.real.float().to(flat.real.dtype), flat.real)
    else:
        exact = torch.equal(flat.float().to(flat.dtype), flat)
    if not exact:
        raise ValueError(f"frozen parameter '{name}' ({str(p.dtype).replace('torch.', '')}) "
                         "holds values fp32 cannot keep exactly, and a checkpoint keeps "
                         "frozen values in fp32: they would load changed. Keep it as a "
                         "buffer (register_buffer keeps its dtype), or in float32")
    return flat.float() if not flat.is_complex() else flat.real.float()


def _param_shapes(engine) -> dict:
    """Canonical parameter name -> (shape, trainable), shapes read from the
    flat groups (a released stage-3 parameter's own shape is (0,))."""
    shapes = {}
    for fg in engine.all_groups:
        for unit in fg.units:
            for j, shape in enumerate(unit.shapes):
                shapes[fg.names[unit.members.start + j]] = (tuple(shape), fg.trainable)
    for name, p in _replicated_frozen(engine):
        shapes[name] = (tuple(p.shape), False)
    return shapes


def _meta(engine, client_state, scheduler_state, shard_files) -> dict:
    module, optimizer = engine.module, engine.optimizer
    names = parameter_names(module)
    state_dict, buffers = [], {}
    for key, t in engine.module_state_entries().items():
        if id(t) in names:
            state_dict.append((key, "param", names[id(t)]))
        else:
            state_dict.append((key, "buffer", None))
            buffers[key] = _host_copy(t)
    steps = {fg.index: fg.step_count for fg in engine.groups}
    states = {fg.index: sorted(fg.states) for fg in engine.groups}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        check_plain(hyper, f"optimizer.param_groups[{gi}]")
        groups.append({"param_names": [names[id(p)] for p in group["params"]],
                       "hyper": hyper, "step": steps.get(gi, 0),
                       "states": states.get(gi, [])})
    params = {name: {"shape": list(shape), "numel": int(torch.Size(shape).numel()),
                     "trainable": trainable}
              for name, (shape, trainable) in _param_shapes(engine).items()}
    scaler = engine.loss_scaler.state_dict() if engine.loss_scaler else None
    return {"format": FORMAT, "version": VERSION, "zero_version": __version__,
            "world_size": engine._comm.world, "stage": engine.stage,
            "precision": engine.config.precision, "optimizer": engine._spec.name,
            "optimizer_class": type(optimizer).__qualname__, "params": params,
            "state_dict": state_dict, "buffers": buffers, "groups": groups,
            "engine": {"micro_steps": engine.micro_steps, "global_steps": engine.global_steps,
                       "skipped_steps": engine.skipped_steps},
            "loss_scaler": scaler, "lr_scheduler": scheduler_state,
            "client_state": client_state, "shards": shard_files}


def _all_ok(engine, error, doing="saving") -> None:
    """A barrier that also tells every rank whether some rank failed, so a
    full disk on one rank raises everywhere instead of hanging the rest,
    and that they are all in this call ([Note: writes agreed])."""
    failed = agree_on_call(engine._comm, engine.call_text(f"{doing} a checkpoint"),
                           refused=error is not None)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{doing} the checkpoint failed on {failed} other rank(s); see "
                           "their errors")


def _gradients_pending(engine) -> bool:
    """Whether this rank holds gradients no step has used: any nonzero
    element in its gradient buffers (a backward's, or a .grad set by hand,
    taken in as the step would)."""
    for fg in engine.groups:
        if not fg.policy.partitions_grads:
            fg.gather_stray_grads()
        grads = fg.grad_flat if fg.grad_flat is not None else fg.grad_part
        if bool(grads.any()):
            return True
    return False


def save(engine, save_dir, tag=None, client_state=None, save_latest=True) -> str:
    comm = engine._comm
    refusal = None
    if engine.micro_steps % engine.config.gradient_accumulation_steps:
        refusal = RuntimeError(
            "save_checkpoint was called in the middle of an accumulation boundary (micro-step "
            f"{engine.micro_steps % engine.config.gradient_accumulation_steps} of "
            f"{engine.config.gradient_accumulation_steps}); gradients are not saved, so call "
            "it after the boundary's engine.step()")
    elif _gradients_pending(engine):
        refusal = RuntimeError(
            "save_checkpoint was called with gradients waiting for step() (a backward since "
            "the last step, or inside no_sync()); gradients are not saved, so a run resumed "
            "from it would step without them. Call it after engine.step(), or drop them with "
            "engine.zero_grad() first")
    try:
        tag = check_tag(f"global_step{engine.global_steps}" if tag is None else tag)
        save_dir = os.fspath(save_dir)
    except (TypeError, ValueError) as error:
        refusal = refusal or error
    # a collective that raises on every rank alike (a refusal on one rank
    # too): before the per-rank work
    take_in_parameter_writes(engine.all_groups, engine.call_text("save_checkpoint()"), refusal)
    path = os.path.join(save_dir, tag)
    error, lock = None, None
    if comm.everyone.rank == 0:
        try:  # before the save id's broadcast, which every rank waits for
            lock = prepare_staging(save_dir, tag)
        except Exception as e:
            error = e
    try:
        save_id = _agreed_save_id(comm)
        _save_agreed(engine, save_dir, tag, save_id, client_state, save_latest, error)
    except BaseException:
        # every rank is past the failed agreement: nothing writes into
        # the staging directory any more (a kill leaves it to the next save)
        if lock is not None:
            discard_staging(save_dir, tag)
        raise
    finally:
        if lock is not None:
            lock.release()
    return path


def _save_agreed(engine, save_dir, tag, save_id, client_state, save_latest, error):
    """The save's writes, each step agreed over the ranks; `error` is rank
    0's from preparing the staging directory."""
    comm = engine._comm
    meta = None
    # [Note: a save replaces a tag whole] in checkpoint/_writes.py
    staging = staging_directory(save_dir, tag)
    try:  # this rank's checks and shard; a failure is raised on every rank by _all_ok
        if error is not None:
            raise error
        client_state = {} if client_state is None else client_state
        check_plain(client_state, "client_state")
        scheduler_state = engine.lr_scheduler.state_dict() if engine.lr_scheduler else None
        check_plain(scheduler_state, "lr_scheduler.state_dict()")
        os.makedirs(staging, exist_ok=True)
        try:
            groups = _shard_groups(engine)
            if groups:
                with _dropping_offloaded(engine):
                    write_file({"format": FORMAT, "version": VERSION, "rank": comm.rank,
                                "save_id": save_id, "groups": groups},
                               os.path.join(staging, shard_file(comm.rank)))
        finally:  # offloaded states were read through their mapping
            _release_offloaded(engine)
        if comm.everyone.rank == 0:
            shard_files = [shard_file(r) for r in range(comm.world if engine.policy.partitions else 1)]
            meta = _meta(engine, client_state, scheduler_state, shard_files)
            meta["save_id"] = save_id
    except Exception as e:
        error = e
    _all_ok(engine, error)
    # the meta only once every shard is on the disk, then the staging
    # directory replaces the tag whole
    try:
        if comm.everyone.rank == 0:
            write_file(meta, os.path.join(staging, META_FILE))
            publish(save_dir, tag)
    except Exception as e:
        error = e
    _all_ok(engine, error)
    if save_latest:
        try:
            if comm.everyone.rank == 0:
                write_latest(save_dir, tag)
        except Exception as e:
            error = e
        _all_ok(engine, error)
    if comm.everyone.rank == 0:
        discard_replaced(save_dir, tag)


def _agreed_save_id(comm) -> int:
    """A number rank 0 draws for this save and every rank writes into its
    files, so a tag that holds files of two saves (one that failed halfway
    over an older one) is refused instead of loaded as a mixture."""
    drawn = int.from_bytes(os.urandom(7), "little")
    t = torch.tensor([drawn], dtype=torch.int64, device=comm.scalar_device)
    comm.everyone.broadcast(t, src=0)
    return int(t.item())


# ---- load -----------------------------------------------------------------------


def _nothing_to_load(engine, load_dir, tag) -> bool:
    """No tag asked for, and the directory holds no checkpoint at all (it is
    missing, or has neither `latest` nor a tag directory): the "resume if
    there is one" start of a run, which DeepSpeed answers with (None, None).
    Agreed over the ranks: with node-local disks, one rank may see one."""
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
    others = agree_on_call(engine._comm, engine.call_text("load_checkpoint()"), refused=empty)
    if others != (engine._comm.dp_world - 1 if empty else 0):
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
    ours = _param_shapes(engine)
    missing = [n for n in ours if n not in saved]
    extra = [n for n in saved if n not in ours]
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
    for gi, (saved, group) in enumerate(zip(meta["groups"], groups)):
        ours = [names[id(p)] for p in group["params"]]
        if sorted(ours) != sorted(saved["param_names"]):
            only_here = sorted(set(ours) - set(saved["param_names"]))
            only_saved = sorted(set(saved["param_names"]) - set(ours))
            what = "; ".join(f"{label}: {', '.join(repr(n) for n in found[:3])}"
                             f"{' ...' if len(found) > 3 else ''}"
                             for label, found in (("only in the optimizer", only_here),
                                                  ("only in the checkpoint", only_saved))
                             if found) or "the same names, another count"
            raise ValueError(f"param group {gi} holds other parameters than in the "
                             f"checkpoint ({what})" + hint)
    for fg in engine.groups:
        # the saved hyperparameters replace the optimizer's: the engine
        # must keep the states they ask for (amsgrad, momentum); it may
        # keep more (saved during a momentum warm-up at 0: the buffer is
        # in the checkpoint, and used again when the momentum comes back)
        saved_states = set(engine._spec.states(meta["groups"][fg.index]["hyper"]))
        if not saved_states <= set(fg.states):
            raise ValueError(f"param group {fg.index} was saved with hyperparameters that keep "
                             f"the states {sorted(saved_states)}, the engine's optimizer keeps "
                             f"{sorted(fg.states)} (amsgrad or momentum differ)" + hint)
        for name in fg.names:
            for key in fg.states:
                if not reader.has_state(name, key):
                    raise ValueError(f"the checkpoint has no optimizer state {key!r} for "
                                     f"parameter '{name}'" + hint)


def _targets(engine, with_optimizer):
    """(flat group, name, lo, hi, offset, keys): what this rank reads."""
    for fg in engine.all_groups:
        keys = ["value"] + (list(fg.states) if with_optimizer and fg.trainable else [])
        for name, lo, hi, offset in owned_pieces(fg):
            yield fg, name, lo, hi, offset, keys


def _check_stored(engine, reader, with_optimizer):
    """Every stretch this rank will read is in the files: checked before
    anything is overwritten, so a damaged checkpoint leaves the engine as
    it was."""
    for _fg, name, lo, hi, _offset, keys in _targets(engine, with_optimizer):
        for key in keys:
            reader.check(name, key, lo, hi - lo)
    for name, p in _replicated_frozen(engine):
        reader.check(name, "value", 0, p.numel())


def _release_offloaded(engine):
    for fg in engine.all_groups:  # stage 3's frozen shard may be in a file too
        fg.release_offloaded()


_COPY_CHUNK = 1 << 22  # elements a load copies between two drops of a file's pages


def _in_files(engine) -> bool:
    return any(fg.offload is not None or fg.param_files is not None
               for fg in engine.all_groups)


def _dropping_offloaded(engine):
    """For an engine whose partitions live in files: their mappings' pages
    dropped while torch.save reads them, so a model larger than memory is
    saved in what the save touches between two drops
    (offload/_mapped.py's PagesDroppedMeanwhile)."""
    if not _in_files(engine):
        return contextlib.nullcontext()
    return PagesDroppedMeanwhile(lambda: _release_offloaded(engine))


def _load_partitions(engine, reader, with_optimizer):
    try:
        _read_partitions(engine, reader, with_optimizer)
    finally:  # offloaded states were written through their mapping
        _release_offloaded(engine)


def _read_partitions(engine, reader, with_optimizer):
    for fg in engine.all_groups:
        fg.check_shard_writable()
        fg.settle_copies()
    # a model on a disk: each copy's pages (the checkpoint's and the
    # files') are dropped once it is done, so loading holds one piece
    in_files = _in_files(engine)
    mappings = reader.file_mappings() if in_files else None
    for fg, name, lo, hi, offset, keys in _targets(engine, with_optimizer):
        for key in keys:
            target = fg.states[key] if key != "value" else \
                fg.master if fg.trainable else fg.shard
            reader.read_into(name, key, lo, target[offset:offset + hi - lo])
            if in_files:
                fg.release_offloaded()
                reader.drop_pages(mappings)
    for fg in engine.all_groups:
        if fg.trainable and fg.master is not fg.shard:
            # the parameters: the master rounded, a chunk at a time
            for lo in range(0, fg.part_size, _COPY_CHUNK):
                hi = min(lo + _COPY_CHUNK, fg.part_size)
                fg.shard[lo:hi].copy_(fg.master[lo:hi])
                if in_files:
                    fg.release_offloaded()
        fg.all_gather_params()
    with torch.no_grad():
        for name, p in _replicated_frozen(engine):
            p.copy_(reader.read(name).view(p.shape))


def _reset_optimizer(engine):
    """load_optimizer_states=False: the optimizer starts afresh on the
    loaded weights, as one just built would."""
    for fg in engine.groups:
        fills = fresh_states(engine.optimizer, engine._spec,
                             engine.optimizer.param_groups[fg.index])
        for name, t in fg.states.items():
            # a state the group's settings no longer ask for (momentum set
            # to 0 since initialize) is kept, and starts from zero too
            t.fill_(fills.get(name, 0.0))
        fg.step_count = 0
    _release_offloaded(engine)


def _buffer_items(engine):
    names = parameter_names(engine.module)
    return [(k, t) for k, t in engine.module_state_entries().items() if id(t) not in names]


def _check_buffers(engine, meta):
    """The same buffers, by name and shape, as the parameters are checked:
    a saved buffer the model lacks means another model."""
    ours = dict(_buffer_items(engine))
    extra = [key for key in meta["buffers"] if key not in ours]
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


def load(engine, load_dir, tag=None, load_optimizer_states=True,
         load_lr_scheduler_states=True, load_module_only=False):
    if _nothing_to_load(engine, load_dir, tag):
        warnings.warn(f"load_checkpoint: {os.fspath(load_dir)!r} holds no checkpoint yet; "
                      "nothing was loaded (returned None, None, as DeepSpeed does)",
                      RuntimeWarning, stacklevel=3)
        return None, None
    with_optimizer = load_optimizer_states and not load_module_only
    error = None
    try:
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
    except Exception as e:  # raised on every rank, before anything changes
        error = e
    _all_ok(engine, error, "loading")
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
    elif not load_module_only:
        _reset_optimizer(engine)
    if not load_module_only:
        # saved at a boundary: the next micro-step starts an accumulation
        # window also when this engine accumulates over another count (a
        # global batch kept at another world size)
        accumulation = engine.config.gradient_accumulation_steps
        engine.micro_steps = -(-meta["engine"]["micro_steps"] // accumulation) * accumulation
        engine.global_steps = meta["engine"]["global_steps"]
        # checkpoints written before it was recorded: none known
        engine.skipped_steps = meta["engine"].get("skipped_steps", 0)
        if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(meta["loss_scaler"])
        if load_lr_scheduler_states and engine.lr_scheduler is not None and \
                meta["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
            # the schedule's current lr, also where the optimizer's
            # hyperparameters were not loaded
            for group, lr in zip(engine.optimizer.param_groups,
                                 getattr(engine.lr_scheduler, "_last_lr", None) or []):
                group["lr"] = lr
    return path, meta["client_state"]

"""engine.save_checkpoint: each rank writes its own partitions, rank 0
the meta, and the staging directory replaces the tag whole once every
file is on the disk. The layout is in checkpoint/_format.py ([Note:
checkpoint layout]).

A collective: every rank calls it with the same arguments, and every rank
must be able to read every file (a shared filesystem across machines).
"""
from __future__ import annotations

import contextlib
import os

import torch

from zero.config._values import require_bool
from zero._progress import bar
from zero._version import __version__
from zero.checkpoint._engine_parts import (all_ok, checkpoint_name, holds_a_part, host_copy,
                                           in_files, in_whole_tensors, param_shapes,
                                           release_offloaded, replicated_frozen, shard_index,
                                           whole_comm)
from zero.checkpoint._client_states import client_files, differ, digest, write_own
from zero.checkpoint._extra_states import extra_state_modules, owner_name, snapshot
from zero.checkpoint._format import (FORMAT, META_FILE, REPLICATED_GROUP, VERSION, _latest_tag,
                                     check_tag, shard_file, staging_directory,
                                     tag_directory_hint)
from zero.checkpoint._plain_values import check_plain, plain_numbers
from zero.checkpoint._recovery_script import leave_recovery_script
from zero.checkpoint._stage_parts import merged_stages, stage_part, writes_stage_meta
from zero.checkpoint._writes import (discard_replaced, discard_staging, prepare_staging, publish,
                                     unpublish, write_file, write_latest)
from zero.offload._mapped import PagesDroppedMeanwhile
from zero.sharding._param_writes import take_in_parameter_writes
from zero.sharding._units import parameter_names, uncompiled


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
            tensors = {"value": host_copy(fg.master)}
            tensors.update({k: host_copy(t) for k, t in fg.states.items()})
        else:
            tensors = {"value": host_copy(fg.shard)}
        groups.append({"index": fg.index, "tensors": tensors,
                       "pieces": in_whole_tensors(engine, fg.owned_pieces())})
    frozen = replicated_frozen(engine)
    if frozen and rank == 0:
        pieces, offset = [], 0
        for name, p in frozen:
            pieces.append((name, 0, p.numel(), offset))
            offset += p.numel()
        value = torch.cat([_as_fp32_exactly(name, p) for name, p in frozen])
        groups.append({"index": REPLICATED_GROUP, "tensors": {"value": value},
                       "pieces": in_whole_tensors(engine, pieces)})
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


def _meta(engine, client_state, scheduler_state, shard_files) -> dict:
    module, optimizer = engine.module, engine.optimizer
    names = parameter_names(module)
    state_dict, buffers, extra_states = [], {}, {}
    extra = extra_state_modules(uncompiled(module))  # [Note: extra state]
    for key, t in engine.module_state_entries().items():
        if key in extra:
            state_dict.append((key, "extra_state", None))
            check_plain(t, f"the extra state of module '{owner_name(key)}' "
                           f"({type(extra[key]).__name__}.get_extra_state())")
            extra_states[key] = snapshot(t)
        elif id(t) in names:
            state_dict.append((key, "param", checkpoint_name(engine, names[id(t)])))
        else:
            state_dict.append((key, "buffer", None))
            buffers[key] = host_copy(t)
    steps = {fg.index: fg.step_count for fg in engine.groups}
    states = {fg.index: sorted(fg.states) for fg in engine.groups}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        hyper = plain_numbers({k: v for k, v in group.items() if k != "params"})
        check_plain(hyper, f"optimizer.param_groups[{gi}]")
        groups.append({"param_names": [checkpoint_name(engine, names[id(p)])
                                       for p in group["params"]],
                       "hyper": hyper, "step": steps.get(gi, 0),
                       "states": states.get(gi, [])})
    params = {name: {"shape": list(shape), "numel": int(torch.Size(shape).numel()),
                     "trainable": trainable}
              for name, (shape, trainable) in param_shapes(engine).items()}
    scaler = engine.loss_scaler.state_dict() if engine.loss_scaler else None
    return {"format": FORMAT, "version": VERSION, "zero_version": __version__,
            "world_size": engine._comm.world, "stage": engine.stage,
            "tensor_parallel": engine._tensor_parallel.world if engine._tensor_parallel else 1,
            "pipeline_stages": engine._pipeline.count if engine._pipeline else 1,
            "precision": engine.config.precision, "optimizer": engine._spec.name,
            "optimizer_class": type(optimizer).__qualname__, "params": params,
            "state_dict": state_dict, "buffers": buffers, "extra_states": extra_states,
            "groups": groups,
            "engine": {"micro_steps": engine.micro_steps, "global_steps": engine.global_steps,
                       "skipped_steps": engine.skipped_steps},
            "loss_scaler": scaler, "lr_scheduler": scheduler_state,
            "client_state": client_state, "shards": shard_files}


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
    refusal = None
    # boundaries set by hand (set_gradient_accumulation_boundary) count none
    # pending: the pending gradients below tell alone
    if engine.pending_micro_batches:
        refusal = RuntimeError(
            "save_checkpoint was called in the middle of an accumulation boundary (micro-step "
            f"{engine.pending_micro_batches} of "
            f"{engine.config.gradient_accumulation_steps}); gradients are not saved, so call "
            "it after the boundary's engine.step()")
    elif _gradients_pending(engine):
        refusal = RuntimeError(
            "save_checkpoint was called with gradients waiting for step() (a backward since "
            "the last step, or inside no_sync()); gradients are not saved, so a run resumed "
            "from it would step without them. Call it after engine.step(), or drop them with "
            "engine.zero_grad() first")
    try:
        tag = check_tag(f"global_step{engine.global_steps}" if tag is None else tag,
                        saving=True)
        if not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"save_dir must be a path, got {type(save_dir).__name__} "
                            f"{save_dir!r}")
        save_dir = os.fspath(save_dir)
        if os.path.isfile(os.path.join(save_dir, META_FILE)):
            # a checkpoint nested in another's tag, which loading that tag
            # then read in its place
            raise ValueError("save_checkpoint: " + tag_directory_hint(save_dir))
        require_bool(save_latest, "save_latest")  # "no" rewrote latest
    except (TypeError, ValueError) as error:
        refusal = refusal or error
    # a collective that raises on every rank alike (a refusal on one rank
    # too): before the per-rank work. The tag is in it: ranks that saved
    # under tags of their own each waited for the others' shards in its
    # own directory, and blamed the filesystem
    # save_latest too: it decides whether one more agreement runs, and
    # differing ranks went on one collective apart
    take_in_parameter_writes(engine.all_groups, engine.call_text(
        f"save_checkpoint(tag={tag!r}, save_latest={save_latest!r})"), refusal)
    path = os.path.join(save_dir, tag)
    error, lock = None, None
    whole = whole_comm(engine)
    if whole.rank == 0:
        try:  # before the save id's broadcast, which every rank waits for
            lock = prepare_staging(save_dir, tag)
        except Exception as e:
            error = e
    try:
        save_id = _agreed_save_id(whole)
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
    comm, whole = engine._comm, whole_comm(engine)
    meta, own_digest = None, 0
    # [Note: a save replaces a tag whole] in checkpoint/_writes.py
    staging = staging_directory(save_dir, tag)
    try:  # this rank's checks and shard; a failure is raised on every rank by all_ok
        if error is not None:
            raise error
        client_state = {} if client_state is None else client_state
        check_plain(client_state, "client_state")
        if engine.stage == 3:  # [Note: per-rank client_state]
            own_digest = digest(client_state)
        scheduler_state = plain_numbers(engine.lr_scheduler.state_dict()) \
            if engine.lr_scheduler else None
        check_plain(scheduler_state, "lr_scheduler.state_dict()")
        os.makedirs(staging, exist_ok=True)
        try:
            groups = _shard_groups(engine)
            if groups:
                nbytes = sum(t.nbytes for g in groups for t in g["tensors"].values())
                with _dropping_offloaded(engine), \
                        bar("saving checkpoint (rank 0's shard)", total=nbytes,
                            enabled=whole.rank == 0) as progress:
                    write_file({"format": FORMAT, "version": VERSION, "rank": comm.rank,
                                "save_id": save_id, "groups": groups},
                               os.path.join(staging, shard_file(shard_index(engine))),
                               on_write=progress.update)
        finally:  # offloaded states were read through their mapping
            release_offloaded(engine)
        if whole.rank == 0 or writes_stage_meta(engine):
            shard_files = [shard_file(r) for r in range(shard_index(engine, count=True))]
            meta = _meta(engine, client_state, scheduler_state, shard_files)
            meta["save_id"] = save_id
    except Exception as e:
        error = e
    all_ok(engine, error)
    if engine.stage == 3 and differ(whole, own_digest):
        try:
            write_own(staging, whole.rank, save_id, client_state)
            if meta is not None:
                meta["client_states"] = client_files(whole.world)
        except Exception as e:
            error = e
        all_ok(engine, error)
    stages = None
    if holds_a_part(engine):  # every stage's parameters, into one meta
        stages = whole.gather_objects((engine._pipeline.index, stage_part(engine, meta))
                                      if writes_stage_meta(engine) else None)
    # the meta only once every shard is on the disk, then the staging
    # directory replaces the tag whole
    try:
        if whole.rank == 0:
            if stages is not None:
                meta.update(merged_stages([part for part in stages if part is not None]))
            _check_shards_seen(staging, meta["shards"] + meta.get("client_states", []))
            write_file(meta, os.path.join(staging, META_FILE))
            publish(save_dir, tag)
    except Exception as e:
        error = e
    all_ok(engine, error)
    if save_latest:
        named_before = whole.rank == 0 and _latest_names(save_dir, tag)
        try:
            if whole.rank == 0:
                write_latest(save_dir, tag)
        except Exception as e:
            error = e
            try:  # the tag as it was, unless `latest` came to name the new one
                # (the failure was after its rename: a sync of the directory)
                if named_before or not _latest_names(save_dir, tag):
                    unpublish(save_dir, tag)
            except OSError:
                pass  # the new tag stays, whole; the error still says the save failed
        all_ok(engine, error)
    if whole.rank == 0:
        discard_replaced(save_dir, tag)
        leave_recovery_script(save_dir, tag)


def _latest_names(save_dir, tag) -> bool:
    try:
        return _latest_tag(save_dir) == tag
    except (OSError, ValueError):
        return False


def _check_shards_seen(staging, shards):
    """Rank 0, before it publishes: every rank's shard (and client_state
    file, [Note: per-rank client_state]) is in the directory
    it sees. Ranks that save into directories of their own (a path on each
    machine's local disk) wrote theirs elsewhere; publishing would make
    `latest` name a checkpoint that cannot load, found only at the load."""
    missing = [f for f in shards if not os.path.isfile(os.path.join(staging, f))]
    if missing:
        raise RuntimeError(
            f"save_checkpoint: {len(missing)} of the {len(shards)} files the ranks wrote "
            f"are not in {staging} as rank 0 sees it ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): save_dir must be one directory every "
            "rank sees (a shared filesystem across machines, not each machine's local disk). "
            "Nothing was published; `latest` still names the last checkpoint")


def _agreed_save_id(whole) -> int:
    """A number rank 0 draws for this save and every rank writes into its
    files, so a tag that holds files of two saves (one that failed halfway
    over an older one) is refused instead of loaded as a mixture."""
    drawn = int.from_bytes(os.urandom(7), "little")
    t = torch.tensor([drawn], dtype=torch.int64, device=whole.scalar_device)
    whole.broadcast(t, src=0)
    return int(t.item())


def _dropping_offloaded(engine):
    """For an engine whose partitions live in files: their mappings' pages
    dropped while torch.save reads them, so a model larger than memory is
    saved in what the save touches between two drops
    (offload/_mapped.py's PagesDroppedMeanwhile)."""
    if not in_files(engine):
        return contextlib.nullcontext()
    return PagesDroppedMeanwhile(lambda: release_offloaded(engine))

"""engine.close(): the model and optimizer handed back to plain torch (at
stage 3 every parameter given its full values again), so the model works
without the engine."""
from __future__ import annotations

import torch

from zero.engine._carried_counts import leave_counts
from zero.engine._generation import unroute_generate
from zero.offload._mapped import MappedFile, release_freed_memory
from zero.sharding._ds_attributes import unmark_partitioned
from zero.sharding._param_marks import DEEPSPEED_MARKS, mark, unmark
from zero.step._resumed_states import give_back_optimizer_states

# gathered bytes close() lets go between two trims of the heap (restore_params)
TRIM_BYTES = 64 << 20


def hand_back(engine):
    """close()'s work, once (the engine marks itself closed after). What can
    fail for want of room (the files file-backed parameters come back in)
    is made first, while the engine still runs: a close() that raises
    leaves it as it was, to be closed again once there is room."""
    homes = agreed_param_homes(engine) if engine._schedule is not None else {}
    if engine._delayed is not None:
        engine._delayed.finish()  # the model handed back has the last update
    forget_dropped(engine._hooks, engine.all_groups, unplace=False)  # the hooks off
    engine._hooks = []
    if engine._schedule is not None:
        engine._schedule.remove()
        unroute_generate(engine.module)  # [Note: the model's own generate at stage 3]
        restore_params(engine, homes)
    restore_dtypes(engine)
    # zero.inference froze every parameter: each as it came
    for p, requires_grad in getattr(engine, "_requires_grad_given", ()):
        p.requires_grad_(requires_grad)
    leave_counts(engine)  # [Note: counts carried across close]
    give_back_optimizer_states(engine.optimizer, engine.groups, engine._comm.world)
    if engine._tensor_parallel is not None:  # DTensor parameters again
        engine._tensor_parallel.restore(engine.optimizer)
    resume = getattr(engine.optimizer, "_resume_after_engine", None)  # zero.optim's
    if resume is not None:
        resume()
    unmark_partitioned(engine.all_groups)
    for p in engine.module.parameters():  # frozen ones a stage 0-2 engine kept whole
        held = p.__dict__.get("_zero_held_whole")
        if held is not None and held() in (engine, None):
            unmark(p, "_zero_held_whole")
    for fg in engine.all_groups:
        for p in fg.params:
            unmark(p, "_zero_place")
    close_group_files(engine.all_groups)
    if engine._monitor is not None:
        engine._monitor.close()
    drop_engine_buffers(engine)
    engine._leave_group()


def close_group_files(groups):
    """The groups' offload files: windows and descriptors (an unlinked
    file's space returns once its descriptors and mappings are gone). A
    stage-3 engine dropped without close() while a loss still held its
    graph kept them open, and the disk full: the next initialize on it
    failed for want of room."""
    for fg in groups:
        if fg.offload is not None:
            fg.offload.close()
        if fg.param_files is not None:
            fg.param_files.close()


def drop_engine_buffers(engine):
    """close(), last: the engine lets go of its own buffers (shards,
    masters, gradient partitions and buckets, optimizer states, stage 3's
    gather pool). The model and the optimizer hold what was handed back
    (a view keeps its storage), and a closed engine refuses every call that
    would read them; but a name kept after close() (`engine` in a notebook)
    or the last loss of a stage-3 run (its graph's hooks hold the schedule
    and the groups) kept all of them alive: about the model states twice
    over. Gradients of stages 0-1 are views of the engine's flat buffer:
    handed back only if a backward left values in them since the step
    (zeros are what None means to torch), so the buffer goes otherwise."""
    for fg in engine.all_groups:
        flat = getattr(fg, "grad_flat", None)  # a frozen group has none
        if flat is not None and not bool(flat.any()):
            for p in fg.params:
                if p.grad is not None and \
                        p.grad.untyped_storage().data_ptr() == \
                        flat.untyped_storage().data_ptr():
                    p.grad = None
    drop_group_buffers(engine.all_groups)
    if engine._schedule is not None:
        engine._schedule.pool = None


def drop_group_buffers(groups):
    """The flat groups let go of their buffers (what close() and a dropped
    stage-3 engine share)."""
    for fg in groups:
        fg.reducer = None  # detached by forget_dropped already
        fg.states = {}
        fg.buffers, fg.tensors, fg._registered_at = {}, {}, {}
        fg.shard = fg.master = fg.grad_flat = fg.grad_part = None
        fg.delayed_grad = fg.delayed_params = None
        fg.host_windows = {}
        # the files' mappings (closed by close_group_files): what the model
        # and optimizer were handed back views them on their own
        fg.offload = fg.param_files = None
        for unit in fg.units:
            unit.full = None
            unit._spare = None


def forget_dropped(hooks, groups, unplace, schedule=None):
    """An engine collected without close() (a re-run notebook cell dropped
    it): its gradient hooks off the parameters and its reducers detached,
    so the model trains as a plain one, or under a new engine (the C hooks
    stayed: held alive by the parameters' places, they took every .grad).
    `unplace` (stages 0-2, where the values stay in the parameters): the
    places go too, with the flat buffers they held. A stage-3 model keeps
    them: its values are gone, and the next initialize says so by name.
    close() starts with the same (unplace=False: it gives the places up
    itself, last); after it, there is nothing left to do.
    schedule: a dropped stage-3 engine's (close() passes none): its hooks
    go too, each released parameter is marked as holding no values, the
    places go, and the groups drop their buffers. The hooks held the
    schedule, and the places the groups, so a kept model (or a kept loss,
    whose graph holds the parameters) held the shards, the master and
    every optimizer state of an engine nobody could use: 12 bytes a
    parameter of mixed-precision Adam for nothing."""
    for h in hooks:
        h.remove()
    for fg in groups:
        if getattr(fg, "reducer", None) is not None:
            fg.reducer.detach()
        if unplace or schedule is not None:
            for p in fg.params:
                place = p.__dict__.get("_zero_place")
                if place is None or place.engine() is not None:
                    continue
                if schedule is not None and not place.unit.gathered and p.numel() == 0:
                    mark(p, "_zero_lost", True)  # the next initialize says so by name
                for name in ("_zero_place", *DEEPSPEED_MARKS):
                    unmark(p, name)
    if schedule is not None:
        schedule.remove()
        schedule.pool = None
        close_group_files(groups)  # a kept loss holds the groups: their files' space
        drop_group_buffers(groups)
        if any(p.__dict__.get("_zero_lost") for fg in groups for p in fg.params):
            # the model's forward would meet the placeholders: torch's shape error
            refuse_lost_values_once(schedule.root)


def refuse_lost_values_once(root):
    """A forward pre-hook on the model of a stage-3 engine dropped without
    close() (it holds nothing): each forward is refused by name while a
    parameter holds no values; the first forward that finds every value
    put back removes the hook, so a model trained on afterwards (a re-run
    notebook cell's new engine) pays no walk of its parameters a step."""
    handle = None

    def refuse_or_step_aside(module, _args):
        refuse_lost_values(module)
        handle.remove()
    handle = root.register_forward_pre_hook(refuse_or_step_aside)


def refuse_lost_values(module):
    """Raises, naming the first parameter of `module` that a dropped
    stage-3 engine left holding no values."""
    for name, p in module.named_parameters():
        if p.__dict__.get("_zero_lost") and p.numel() == 0:
            raise RuntimeError(
                f"parameter '{name}' holds no values: the zero stage-3 engine that trained "
                "this model was dropped without close(), which gives the values back (its "
                "released parameters are empty placeholders). Build the model again, or "
                "close() an engine before dropping it")


def agreed_param_homes(engine) -> dict:
    """param_homes, made on every rank or on none: stage 3's close() is a
    collective, and a rank whose files failed (a full disk) raised alone
    while the others waited in restore_params' gathers until the timeout,
    or paired them with its next forward's and closed on wrong values.
    So the ranks compare first, over every rank of the engine, and all
    raise before anything changes: each engine trains on, to be closed
    again once there is room (docs/offload.md, "Errors")."""
    homes, problem = {}, None
    try:
        homes = param_homes(engine)
    except Exception as error:  # noqa: BLE001 - whatever it is, every rank must know
        problem = error
    comm = engine._comm.whole
    if comm.world > 1:
        failed = [r for r, bad in enumerate(comm.gather_scalars(int(problem is not None)))
                  if bad]
        if failed and problem is None:
            homes.clear()  # the files made here go with their mappings
            raise RuntimeError(
                f"close(): rank(s) {failed} of this engine could not make the files their "
                "parameters come back in (their errors say why), so no rank closed: the "
                "engine trains on, and close() on every rank once they have room closes it")
    if problem is not None:
        raise problem
    return homes


def param_homes(engine) -> dict:
    """id(flat group) -> the mapped file its file-backed parameters
    (offload_param "nvme") come back in."""
    return {id(fg): MappedFile(fg.param_files.directory, fg.layout_size,
                               engine.compute_dtype, "offload_param.nvme_path")
            for fg in engine.all_groups if fg.param_files is not None}


# [Note: a resize kept] A parameter given data of another shape since
# initialize (HF's resize_token_embeddings, p.data = a larger tensor),
# which the engine refuses to train, is left as the user made it by close():
# the engine's values of it have the old shape, and writing them back
# undid the resize silently (a new initialize then trained the old shape
# under a config that says the new one). Its optimizer states keep the old
# shape: a new engine for it needs a new optimizer (initialize says so
# before it closes the old engine).
def resized(p, shape) -> bool:
    """Whether p holds data of another shape than the engine's `shape` (a
    released stage-3 placeholder holds none)."""
    return p.numel() != 0 and tuple(p.shape) != tuple(shape)


def restore_params(engine, homes):
    """Stage 3: give every parameter its full values again, in plain
    tensors of its own, so the model works without the engine (a
    collective). Parameters that lived in files (offload_param "nvme")
    come back file-backed, in a mapped file of their own beside the
    shards: the model may be larger than this machine's memory. Those
    kept in host memory apart from a GPU model (offload_param "cpu")
    come back in host memory: the device may not hold the whole model."""
    freed = 0  # bytes of gathered units let go since the last trim
    for fg in engine.all_groups:
        home = homes.get(id(fg))  # made by param_homes before anything was removed
        for unit in fg.units:
            # [Note: a resize kept] before the gather re-points them
            kept = {j: p.data for j, (p, shape) in enumerate(zip(unit.params, unit.shapes))
                    if resized(p, shape)}
            engine._schedule.ensure(fg, unit)
            for j, (p, off, n, shape) in enumerate(zip(unit.params, unit.offsets, unit.numels,
                                                       unit.shapes)):
                if j in kept:
                    p.data = kept[j]
                    continue
                values = unit.full[off:off + n]
                if home is None:
                    p.data = values.view(shape).to(
                        "cpu" if fg.shard_on_host else values.device, copy=True)
                else:
                    start = unit.layout_offset + off
                    home.tensor[start:start + n].copy_(values)
                    p.data = home.tensor[start:start + n].view(shape)
                    home.drop(start, start + n)
            unit.gathered = False
            if home is not None:
                freed += unit.full.numel() * unit.full.element_size()
            unit.full = None
            # every TRIM_BYTES, not every unit: a trim walks the heap (8,000
            # small units took 1.8 s to close, 0.4 s without the trims)
            if freed >= TRIM_BYTES:
                release_freed_memory()
                freed = 0
    if freed:
        release_freed_memory()


# [Note: dtypes given back] initialize casts the model (parameters and
# buffers) to the compute dtype: a float32 model trained with
# precision="bf16" holds bfloat16 parameters while the engine runs, and
# its fp32 master weights live in the engine (started from the model's
# own values, not rounded ones: _construction.cast_module). close() gives
# each tensor its dtype from before initialize again, with the master's
# values where this rank holds the whole master (world size 1, or an
# unpartitioned group): a float32 model comes back with the exact fp32
# weights the optimizer states go with, so plain torch, or a new
# initialize (a re-run notebook cell), goes on as an uninterrupted run. A
# master in an offload file comes back as a view of its mapping, as the
# states do (nothing read into memory). Elsewhere the values are the
# compute dtype's, cast; parameters that came back file-backed
# (offload_param "nvme") without a whole master keep the compute dtype:
# casting would bring the whole model into memory.
def record_dtypes(module) -> dict:
    """The floating dtypes of the module's parameters and buffers before
    initialize casts them, by name."""
    dtypes = {}
    for kind, named in (("parameter", module.named_parameters()),
                        ("buffer", module.named_buffers())):
        for name, t in named:
            if t.is_floating_point():
                dtypes[kind, name] = t.dtype
    return dtypes


def _views_more(t) -> bool:
    """Whether t's storage holds more than t (t is a view into it)."""
    return t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.nbytes


def undo_failed_build(engine, module, error):
    """initialize failed part way (a disk quota met while reserving a later
    group's files; Ctrl-C): the parameters of the groups built point into
    the engine's buffers, in the compute dtype, and at stage 3 those given
    back from the shard ([Note: a failed stage-3 build gives back]) are
    tensors of the shard's dtype. Each gets its dtype back, exactly from
    an fp32 master this rank holds whole, else cast from the values it
    has: compute-dtype values were rounded, which `error` then says by
    name (a retry trained from the rounded weights, silently). A
    parameter that holds no values (a placeholder) is left as it is."""
    dtypes = getattr(engine, "_dtypes_before", None)
    if not dtypes:
        return
    whole = {}  # id(param) -> its values in an fp32 master this rank holds whole
    for fg in getattr(engine, "groups", []):
        if fg.num_partitions == 1 and fg.master is not None and fg.master is not fg.shard:
            for i, p in enumerate(fg.params):
                whole[id(p)] = fg.view(fg.master, i)
    in_groups = {id(p) for fg in getattr(engine, "groups", []) for p in fg.params}
    rounded = []
    with torch.no_grad():
        for name, p in module.named_parameters():
            dtype = dtypes.get(("parameter", name))
            if dtype is None or p.numel() == 0:
                continue
            values = whole.get(id(p))
            if values is None:
                if p.dtype == dtype and id(p) not in in_groups:
                    continue  # its own tensor, as it was (a group not built)
                values = p.data
                if torch.finfo(p.dtype).bits < torch.finfo(dtype).bits:
                    rounded.append(name)
            p.data = values.to(dtype=dtype, copy=True)
        for name, b in module.named_buffers():  # a norm's statistics, cast
            dtype = dtypes.get(("buffer", name))
            if dtype is not None and b.dtype != dtype:
                b.data = b.data.to(dtype)
    if rounded and hasattr(error, "add_note"):
        listed = ", ".join(f"'{n}'" for n in rounded[:4]) + (" ..." if len(rounded) > 4 else "")
        error.add_note(f"zero: initialize failed after casting {len(rounded)} parameter(s) "
                       f"({listed}) to the compute dtype: they have their dtype back, but "
                       "their values are rounded. Reload the model's weights before trying "
                       "again")


def restore_dtypes(engine):
    """close(): each parameter and buffer its dtype from before initialize
    ([Note: dtypes given back])."""
    dtypes = engine._dtypes_before
    masters = {}  # id(param) -> (its fp32 master values, whether in a file)
    for fg in engine.groups:
        if fg.num_partitions == 1 and fg.master is not fg.shard:  # a master of its own
            for i, p in enumerate(fg.params):
                masters[id(p)] = (fg.view(fg.master, i), fg.offload is not None)
    filed = {id(p) for fg in engine.all_groups if fg.param_files is not None
             for p in fg.params}
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            dtype = dtypes.get(("parameter", name))
            if dtype is None:
                continue
            values, in_file = masters.get(id(p), (None, False))
            if values is not None and resized(p, values.shape):
                values = None  # [Note: a resize kept]
            if values is None and (p.dtype == dtype or id(p) in filed):
                if id(p) not in filed and _views_more(p):
                    # a view of the engine's flat buffer (the master itself:
                    # fp32 at stages 0-2): a plain model's parameter has a
                    # storage of its own (safetensors' save_model refused
                    # the shared one, torch.save(p) wrote the whole model)
                    p.data = p.data.clone()
                continue
            if p.grad is not None and p.grad.dtype != dtype:
                p.grad = None  # the engine's, in the compute dtype
            if in_file and values.dtype == dtype:
                p.data = values
            else:
                p.data = (p.data if values is None else values).to(
                    device=p.device, dtype=dtype, copy=True)
        for name, b in engine.module.named_buffers():
            dtype = dtypes.get(("buffer", name))
            if dtype is not None and b.dtype != dtype:
                b.data = b.data.to(dtype)

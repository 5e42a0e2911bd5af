"""engine.close(): the model and optimizer handed back to plain torch (at
stage 3 every parameter given its full values again), so the model works
without the engine."""
from __future__ import annotations

from zero.offload._mapped import MappedFile, release_freed_memory
from zero.step._resumed_states import give_back_optimizer_states


def hand_back(engine):
    """close()'s work, once (the engine marks itself closed after)."""
    if engine._delayed is not None:
        engine._delayed.finish()  # the model handed back has the last update
    for h in engine._hooks:
        h.remove()
    engine._hooks = []
    for fg in engine.groups:
        if fg.reducer is not None:
            fg.reducer.detach()
    if engine._schedule is not None:
        engine._schedule.remove()
        restore_params(engine)
    give_back_optimizer_states(engine.optimizer, engine.groups, engine._comm.world)
    if engine._tensor_parallel is not None:  # DTensor parameters again
        engine._tensor_parallel.restore(engine.optimizer)
    resume = getattr(engine.optimizer, "_resume_after_engine", None)  # zero.optim's
    if resume is not None:
        resume()
    for fg in engine.all_groups:
        for p in fg.params:
            p.__dict__.pop("_zero_place", None)
        if fg.offload is not None:  # its windows and descriptors
            fg.offload.close()
        if fg.param_files is not None:
            fg.param_files.close()
    if engine._monitor is not None:
        engine._monitor.close()
    engine._leave_group()


def restore_params(engine):
    """Stage 3: give every parameter its full values again, in plain
    tensors of its own, so the model works without the engine (a
    collective). Parameters that lived in files (offload_param "nvme")
    come back file-backed, in a mapped file of their own beside the
    shards: the model may be larger than this machine's memory. Those
    kept in host memory apart from a GPU model (offload_param "cpu")
    come back in host memory: the device may not hold the whole model."""
    for fg in engine.all_groups:
        home = None
        if fg.param_files is not None:
            home = MappedFile(fg.param_files.directory, fg.layout_size,
                              engine.compute_dtype, "offload_param.nvme_path")
        for unit in fg.units:
            engine._schedule.ensure(fg, unit)
            for p, off, n, shape in zip(unit.params, unit.offsets, unit.numels,
                                        unit.shapes):
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
            unit.full = None
            if home is not None:
                release_freed_memory()

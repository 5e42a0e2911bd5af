"""close() at stage 3: every parameter given its full values again, so the
model works as a plain torch model without the engine."""
from __future__ import annotations

from zero.offload._mapped import MappedFile, release_freed_memory


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

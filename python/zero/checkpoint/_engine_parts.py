"""What a checkpoint save and load both need to know of the engine: its
frozen parameters outside the flat groups, the parameters' shapes as the
checkpoint keeps them (whole tensors, also under tensor parallelism), the
ranks a save or load agrees over, which shard file a rank writes, and the
barrier that raises every rank's error everywhere."""
from __future__ import annotations

import torch

from zero.sharding._step_agreement import agree_on_call
from zero.sharding._units import uncompiled


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """t for torch.save: as it is when it is a whole host storage (states,
    stage-3 shards, a bf16 master), else copied, since torch.save writes a
    view's whole storage (at fp32 stages 0-2 the master is a chunk of the
    gathered parameters)."""
    t = t.detach()
    whole = t.device.type == "cpu" and t.storage_offset() == 0 and t.is_contiguous() and \
        t.untyped_storage().nbytes() == t.nbytes
    return t if whole else t.to("cpu", copy=True)


def replicated_frozen(engine) -> list:
    """(name, parameter) for the frozen parameters that no flat group holds
    (stages 0-2 keep them whole on every rank)."""
    grouped = {id(p) for fg in engine.all_groups for p in fg.params}
    out, seen = [], set()
    for name, p in uncompiled(engine.module).named_parameters():
        if id(p) not in grouped and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def whole_comm(engine):
    """The Comm over every rank of the engine, which a checkpoint's
    agreements and its one meta writer span: the data-parallel ranks, times
    the tp and pp ranks of a model split over them."""
    return engine._comm.whole


def checkpoint_name(engine, name: str) -> str:
    """The name a checkpoint keeps parameter `name` under: its own, but a
    pipeline stage's tied copy goes by the parameter it copies
    ([Note: pipeline stages] in parallel/_pipeline.py)."""
    pipeline = engine._pipeline
    return name if pipeline is None else pipeline.canonical(name)


def is_copy(engine, name: str) -> bool:
    """A pipeline stage's tied copy: the stage that holds the parameter
    itself writes it."""
    return engine._pipeline is not None and engine._pipeline.is_copy(name)


def in_whole_tensors(engine, pieces) -> list:
    """Pieces of the whole parameters, as a checkpoint keeps them, so it
    loads under any tp and pp size, or in one process: a tensor-parallel
    rank's local pieces turned into the whole tensors' elements, a
    pipeline stage's tied copies left to the stage that holds them."""
    pieces = [p for p in pieces if not is_copy(engine, p[0])]
    tp = engine._tensor_parallel
    return pieces if tp is None else tp.global_pieces(pieces)


def shard_index(engine, count=False) -> int:
    """This rank's shard file number (count=True: how many there are):
    one per data-parallel rank that writes (rank 0 alone at stage 0), for
    each tp rank of each pipeline stage."""
    comm, tp, pp = engine._comm, engine._tensor_parallel, engine._pipeline
    per_tp = comm.world if engine.policy.partitions else 1
    tp_rank, tp_world = (tp.rank, tp.world) if tp is not None else (0, 1)
    pp_rank, pp_world = (pp.index, pp.count) if pp is not None else (0, 1)
    if count:
        return pp_world * tp_world * per_tp
    return (pp_rank * tp_world + tp_rank) * per_tp + comm.rank


def param_shapes(engine) -> dict:
    """Canonical parameter name -> (shape, trainable), shapes read from the
    flat groups (a released stage-3 parameter's own shape is (0,))."""
    shapes = {}
    for fg in engine.all_groups:
        for unit in fg.units:
            for j, shape in enumerate(unit.shapes):
                shapes[fg.names[unit.members.start + j]] = (tuple(shape), fg.trainable)
    for name, p in replicated_frozen(engine):
        shapes[name] = (tuple(p.shape), False)
    tp = engine._tensor_parallel
    if tp is not None:  # the checkpoint keeps whole tensors
        for name, (shape, trainable) in shapes.items():
            if tp.is_sharded(name):
                shapes[name] = (tp.placement(name).global_shape, trainable)
    return {checkpoint_name(engine, name): value for name, value in shapes.items()}


def holds_a_part(engine) -> bool:
    """Whether the engine trains one pipeline stage of a larger model: the
    checkpoint then holds more parameters than it does."""
    return engine._pipeline is not None and engine._pipeline.count > 1


def all_ok(engine, error, doing="saving") -> None:
    """A barrier that also tells every rank whether some rank failed, so a
    full disk on one rank raises everywhere instead of hanging the rest,
    and that they are all in this call ([Note: writes agreed])."""
    failed = agree_on_call(whole_comm(engine), engine.call_text(f"{doing} a checkpoint"),
                           refused=error is not None)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{doing} the checkpoint failed on {failed} other rank(s); see "
                           "their errors")


def release_offloaded(engine):
    for fg in engine.all_groups:  # stage 3's frozen shard may be in a file too
        fg.release_offloaded()


def in_files(engine) -> bool:
    return any(fg.offload is not None or fg.param_files is not None
               for fg in engine.all_groups)

"""Each rank's own client_state in a stage-3 checkpoint, as DeepSpeed keeps it.

[Note: per-rank client_state] DeepSpeed's stage 3 writes a model-states file
per rank, each with that rank's client_state, and each rank loads its own
back; at stages 0-2 only rank 0 writes one and every rank loads rank 0's.
Scripts rely on both: per-rank RNG states or data-loader positions at stage
3, values only rank 0 computed (a best metric) at stages 0-2. zero keeps
rank 0's in the meta at every stage; at stage 3 a save also compares the
ranks' client states (a 63-bit digest of each, one all-gather of integers)
and, when they differ, each rank writes its own into zero_client_RRRRR.pt
beside its shard and the meta lists those files. A load at the same world
size gives each rank its own; at another world size there is no "own" for
every rank, so each gets rank 0's, with a warning (DeepSpeed refuses a stage-3
load at another world size). Ranks that all gave the same client_state (the
usual epoch and step) cost no files and load it at any world size silently.
"""
from __future__ import annotations

import hashlib
import io
import os

import torch

from zero.checkpoint._format import FORMAT, VERSION, client_file
from zero.checkpoint._writes import write_file

_DIGEST_MASK = (1 << 63) - 1  # gather_ints carries signed 64-bit integers


def digest(client_state) -> int:
    """Equal for equal client states (torch.save's bytes of a checked,
    plain value are a function of it: storages are numbered in the order
    met); a tensor saved with a larger storage it views differs, which
    only costs the files."""
    buffer = io.BytesIO()
    torch.save(client_state, buffer)
    return int.from_bytes(hashlib.blake2b(buffer.getvalue(), digest_size=8).digest(),
                          "little") & _DIGEST_MASK


def differ(whole, own_digest: int) -> bool:
    """Whether the ranks' client states differ; a collective over every rank."""
    return len(set(whole.gather_scalars(own_digest))) > 1


def write_own(staging: str, rank: int, save_id: int, client_state) -> None:
    write_file({"format": FORMAT, "version": VERSION, "rank": rank, "save_id": save_id,
                "client_state": client_state}, os.path.join(staging, client_file(rank)))


def client_files(world: int) -> list:
    return [client_file(r) for r in range(world)]


def client_state_for(reader, rank: int, world: int):
    """(client_state, warning or None) for `rank` of `world` loading the
    checkpoint `reader` reads."""
    meta = reader.meta
    files = meta.get("client_states")
    if files is None:
        return meta["client_state"], None
    if len(files) != world:
        return meta["client_state"], (
            f"load_checkpoint: the checkpoint holds a client_state of each of the {len(files)} "
            f"ranks that saved it (they differed), and this run has {world}: every rank gets "
            "rank 0's client_state")
    own = reader.read_file(files[rank])
    full = os.path.join(reader.path, files[rank])
    reader.verify(full)
    if own.get("rank") != rank or "client_state" not in own:
        raise ValueError(f"checkpoint file {full!r} is damaged: it is not rank {rank}'s "
                         "client_state; load another checkpoint")
    return own["client_state"], None

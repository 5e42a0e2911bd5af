"""The on-disk form of a zero checkpoint, and the reader both
engine.load_checkpoint and zero.checkpoint.consolidate use.

[Note: checkpoint layout] A checkpoint is kept in parameter space, not in
the engine's flat layout, so it loads at any world size and any stage:

    <save_dir>/latest                  the newest tag (text), written last
    <save_dir>/<tag>/zero_meta.pt      rank 0: names, shapes, hyperparameters,
                                       step counts, buffers, scheduler, scaler,
                                       client_state, the list of shard files
    <save_dir>/<tag>/zero_shard_RRRRR.pt
                                       one rank's partitions, whole, plus
                                       "pieces": which elements of which
                                       parameter sit where in them

A piece is (parameter name, lo, hi, offset): elements [lo, hi) of the
flattened parameter are at [offset, offset + hi - lo) of the partition
tensors ("value": the fp32 master, or a frozen parameter's values; and one
tensor per optimizer state, named as torch.optim names them). Loading
asks, for each piece the new engine's rank owns, for those elements from
whichever files hold them. Every file holds only tensors, numbers,
strings, lists and dicts, so torch.load(weights_only=True) reads it.
"""
from __future__ import annotations

import os
import pickle
from collections import defaultdict

import torch

FORMAT = "zeroshard.checkpoint"
VERSION = 1
META_FILE = "zero_meta.pt"
LATEST_FILE = "latest"
REPLICATED_GROUP = "replicated"  # stage 0-2 frozen parameters, saved by rank 0
PLAIN_TYPES = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.device)


def shard_file(rank: int) -> str:
    return f"zero_shard_{rank:05d}.pt"


def owned_pieces(fg) -> list:
    """(name, lo, hi, offset) for every stretch of a parameter in this
    rank's partition of the flat group `fg` (its chunk of each unit; see
    [Note: flat group layout])."""
    pieces = []
    for unit in fg.units:
        chunk_lo = fg.owner * unit.part
        chunk_hi = chunk_lo + unit.part
        for j, (start, n) in enumerate(zip(unit.offsets, unit.numels)):
            lo, hi = max(start, chunk_lo), min(start + n, chunk_hi)
            if lo < hi:
                pieces.append((fg.names[unit.members.start + j], lo - start, hi - start,
                               unit.shard_offset + lo - chunk_lo))
    return pieces


def check_plain(value, where: str):
    """Refuse what torch.load(weights_only=True) could not read back,
    naming where it sits (client_state['a'][2])."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where} has a key of type {type(k).__name__}; a checkpoint "
                                "keeps str and int keys only")
            check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, PLAIN_TYPES):
        raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__name__}; a "
                        "checkpoint keeps only tensors, numbers, strings, None and lists or "
                        "dicts of them (so it loads with torch.load(weights_only=True))")


def resolve_tag(save_dir, tag=None) -> str:
    """The tag directory to read: `tag`, or the one named in <save_dir>/latest."""
    save_dir = os.fspath(save_dir)
    if not os.path.isdir(save_dir):
        raise FileNotFoundError(f"checkpoint directory {save_dir!r} does not exist")
    if tag is None:
        latest = os.path.join(save_dir, LATEST_FILE)
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"{latest!r} does not exist: pass tag= to say which "
                                    "checkpoint in this directory to load")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(save_dir, str(tag))
    if not os.path.isfile(os.path.join(path, META_FILE)):
        raise FileNotFoundError(f"{path!r} holds no zero checkpoint ({META_FILE} is missing)")
    return path


class CheckpointReader:
    """Reads any stretch of any parameter's value or optimizer state from a
    checkpoint directory, whatever world size and stage wrote it. Shard
    files are memory-mapped: only the stretches asked for are read."""

    def __init__(self, path: str):
        self.path = path
        self.meta = self._load(META_FILE)
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{path!r} is not a zero checkpoint (format "
                             f"{self.meta.get('format')!r})")
        if self.meta.get("version") != VERSION:
            raise ValueError(f"{path!r} has checkpoint version {self.meta.get('version')}; "
                             f"this zero reads version {VERSION}")
        self.index = defaultdict(list)  # name -> [(lo, hi, tensors, offset)]
        for file in self.meta["shards"]:
            shard = self._load(file, mmap=True)
            if shard.get("save_id") != self.meta.get("save_id"):
                raise ValueError(f"{os.path.join(path, file)!r} belongs to another save than "
                                 f"{META_FILE} (a save into this tag that did not finish?); "
                                 "load another checkpoint")
            for group in shard["groups"]:
                for name, lo, hi, offset in group["pieces"]:
                    self.index[name].append((lo, hi, group["tensors"], offset))

    def _load(self, file, mmap=False):
        full = os.path.join(self.path, file)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"checkpoint file {full!r} is missing (every rank's shard "
                                    "must be readable from every loading rank)")
        try:
            return torch.load(full, map_location="cpu", weights_only=True, mmap=mmap)
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
            raise ValueError(f"checkpoint file {full!r} cannot be read, so it is truncated or "
                             f"damaged ({type(error).__name__}: {error}); load another "
                             "checkpoint") from error

    def has_state(self, name: str, key: str) -> bool:
        pieces = self.index.get(name)
        return bool(pieces) and all(key in tensors for _lo, _hi, tensors, _o in pieces)

    def _stretches(self, name: str, key: str, lo: int, hi: int):
        """(a, b, source) for each stored stretch [a, b) of [lo, hi); raises
        unless together they cover it."""
        found, covered = [], 0
        for p_lo, p_hi, tensors, offset in self.index.get(name, ()):
            a, b = max(lo, p_lo), min(hi, p_hi)
            if a >= b:
                continue
            if key not in tensors:
                raise KeyError(f"the checkpoint has no {key!r} for parameter '{name}'")
            found.append((a, b, tensors[key][offset + a - p_lo:offset + b - p_lo]))
            covered += b - a
        if covered != hi - lo:
            raise ValueError(f"the checkpoint holds {covered} of elements [{lo}, {hi}) of "
                             f"'{name}' {key!r}: a shard file is missing or damaged")
        return found

    def check(self, name: str, key: str, lo: int, n: int):
        """Raise unless elements [lo, lo + n) of `name`'s `key` are stored."""
        self._stretches(name, key, lo, lo + n)

    def read_into(self, name: str, key: str, lo: int, out: torch.Tensor):
        """out (1-D, any dtype and device) = elements [lo, lo + out.numel())
        of the flattened `name`'s `key` ("value" or a state name)."""
        for a, b, source in self._stretches(name, key, lo, lo + out.numel()):
            out[a - lo:b - lo].copy_(source)

    def read(self, name: str, key: str = "value") -> torch.Tensor:
        """The whole parameter's `key`, fp32, in its shape."""
        info = self.meta["params"][name]
        out = torch.empty(info["numel"], dtype=torch.float32)
        self.read_into(name, key, 0, out)
        return out.view(info["shape"])

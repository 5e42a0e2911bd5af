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
    <save_dir>/<tag>/zero_client_RRRRR.pt
                                       stage 3: a rank's own client_state
                                       ([Note: per-rank client_state])

A piece is (parameter name, lo, hi, offset): elements [lo, hi) of the
flattened parameter are at [offset, offset + hi - lo) of the partition
tensors ("value": the fp32 master, or a frozen parameter's values; and one
tensor per optimizer state, named as torch.optim names them). Loading
asks, for each piece the new engine's rank owns, for those elements from
whichever files hold them. Every file holds only tensors, numbers,
strings, lists and dicts, so torch.load(weights_only=True) reads it.
"""
from __future__ import annotations

import numbers
import os
import pickle
import zipfile
from collections import defaultdict

import torch

from zero.checkpoint._refused_files import (deepspeed_refusal, deepspeed_tags,
                                            holds_deepspeed_files, holds_code,
                                            not_an_archive, runs_code, unreadable)
from zero.checkpoint._storage_sizes import storage_size_mismatch
from zero.checkpoint._zip_checksums import damaged_record
from zero.offload._mapped import drop_file_mapped_pages, file_mappings
from zero.step._registry import SPECS

FORMAT = "zeroshard.checkpoint"
VERSION = 1
META_FILE = "zero_meta.pt"
LATEST_FILE = "latest"
# the folder of an HF Trainer checkpoint-N that holds ZeroTrainer's zero
# checkpoint (integrations/hf.py)
HF_ZERO_DIR = "zero_checkpoint"
# the script a save leaves beside the tags (checkpoint/_recovery_script.py)
SCRIPT_FILE = "zero_to_fp32.py"
REPLICATED_GROUP = "replicated"  # stage 0-2 frozen parameters, saved by rank 0
STAGING_SUFFIX = ".zero-save.tmp"  # .<tag>.zero-save.tmp: a save in progress
REPLACED_SUFFIX = ".zero-old.tmp"  # .<tag>.zero-old.tmp: the checkpoint it replaces
LOCK_SUFFIX = ".zero-save.lock"  # .<tag>.zero-save.lock: held by the saving rank 0
# exact types: torch.load(weights_only=True) refuses a subclass (an IntEnum,
# a namedtuple, a str subclass) as code it would run, so one that passed an
# isinstance check here made a checkpoint that replaced a good one and could
# never be loaded
_NAME_MAX = 255  # bytes in a file name (Linux's, and most file systems')


def shard_file(rank: int) -> str:
    return f"zero_shard_{rank:05d}.pt"


def client_file(rank: int) -> str:
    """A rank's own client_state, where a stage-3 save's ranks gave
    different ones ([Note: per-rank client_state] in _client_states.py)."""
    return f"zero_client_{rank:05d}.pt"


def check_tag(tag, saving: bool = False) -> str:
    """A tag names a directory inside the checkpoint directory, never a
    path out of it (an absolute path, or one through '..'), nor one of the
    names a save works under. An integer (numpy's too) is taken as its
    digits, as DeepSpeed takes a step count. saving: a new tag, which also
    may not have white space at an end or control characters (`latest` is
    read stripped: such a tag saved, and did not resume); one an earlier
    version saved still loads by its name."""
    if isinstance(tag, numbers.Integral) and not isinstance(tag, bool):
        tag = str(int(tag))
    if type(tag) is not str:
        raise TypeError(f"tag must be a str (or an int), got {type(tag).__name__} {tag!r}")
    if saving and (tag != tag.strip() or any(ord(c) < 32 or ord(c) == 127 for c in tag)):
        raise ValueError(f"tag {tag!r} has leading or trailing white space or a control "
                         "character; choose a plain name")
    separators = {"/", os.sep, os.altsep} - {None}
    if not tag or tag in (".", "..") or any(s in tag for s in separators):
        raise ValueError(f"tag {tag!r} must be a plain directory name (no path separators)")
    longest = len(f".{tag}{max(STAGING_SUFFIX, REPLACED_SUFFIX, LOCK_SUFFIX, key=len)}".encode())
    if saving and longest > _NAME_MAX:
        raise ValueError(f"tag is {len(tag.encode())} bytes long; a save names directories "
                         f"after it that must fit the file system's {_NAME_MAX} bytes a name: "
                         f"use at most {len(tag.encode()) - (longest - _NAME_MAX)} bytes")
    if tag.endswith((STAGING_SUFFIX, REPLACED_SUFFIX, LOCK_SUFFIX)):
        raise ValueError(f"tag {tag!r} ends as the directories a save works in do; choose "
                         "another name")
    if saving and tag == LATEST_FILE:
        # the file naming the newest tag lives beside the tags under this name:
        # the save failed at its last write, or into a directory that had one
        raise ValueError(f"tag {tag!r} is the name of the file that names the newest tag in "
                         "the checkpoint directory; choose another name")
    return tag


def staging_directory(save_dir, tag) -> str:
    """Where a save into `tag` writes its files before they replace the
    tag's ([Note: a save replaces a tag whole] in checkpoint/_writes.py)."""
    return os.path.join(save_dir, f".{tag}{STAGING_SUFFIX}")


def replaced_directory(save_dir, tag) -> str:
    """Where the tag's previous checkpoint waits while a save replaces it."""
    return os.path.join(save_dir, f".{tag}{REPLACED_SUFFIX}")


def inside(root, path) -> bool:
    """Whether path, every link resolved, lies inside the directory root
    (resolved too: a checkpoint directory may itself be a link)."""
    root, path = os.path.realpath(root), os.path.realpath(path)
    return path != root and os.path.commonpath([root, path]) == root


def tag_directory_hint(save_dir) -> str:
    """The checkpoint directory given as one of its tag directories
    (ckpt/global_step5 for ckpt/) is an easy slip: say so. A DeepSpeed
    checkpoint directory (or tag directory) is named as one, and so is an
    HF Trainer's checkpoint-N folder, whose zero checkpoint is one level
    down (DeepSpeed users give the folder itself)."""
    if not os.path.isfile(os.path.join(save_dir, META_FILE)):
        inner = os.path.join(save_dir, HF_ZERO_DIR)
        if os.path.isfile(os.path.join(inner, LATEST_FILE)):
            return (f"{save_dir!r} is an HF Trainer checkpoint folder: its zero checkpoint is "
                    f"in {inner!r}; pass that directory")
        return deepspeed_refusal(save_dir) if deepspeed_tags(save_dir) else ""
    parent, name = os.path.split(os.path.abspath(save_dir))
    return (f"{save_dir!r} is itself a checkpoint's tag directory (it holds {META_FILE}): "
            f"pass its parent {parent!r} and the tag {name!r} (tag= in Python, --tag on the "
            "command line)")


_LATEST_MOST = 4096  # bytes: a tag name; a longer `latest` is not one of ours


def _latest_tag(save_dir) -> str:
    """The tag <save_dir>/latest names. Its contents are never quoted in an
    error: a `latest` that is not zero's may hold anything."""
    latest = os.path.join(save_dir, LATEST_FILE)
    if not os.path.lexists(latest):
        raise FileNotFoundError(tag_directory_hint(save_dir) or
                                f"{latest!r} does not exist: pass tag= (--tag on the command "
                                "line) to say which checkpoint in this directory to load")
    if not inside(save_dir, latest):
        raise ValueError(f"{latest!r} is a link to a file outside {save_dir!r}; a checkpoint "
                         "is read from inside its directory only")
    if not os.path.isfile(latest):  # a directory, a FIFO (whose read would wait forever)
        raise ValueError(f"{latest!r} is not a regular file")
    try:
        with open(latest, "rb") as f:
            tag = f.read(_LATEST_MOST + 1).decode("utf-8").strip()
        if len(tag) > _LATEST_MOST:
            raise ValueError("too long")
        return check_tag(tag)
    except ValueError:  # a damaged file, or one naming a path out of save_dir
        raise ValueError(f"{latest!r} does not name a tag directory inside {save_dir!r} "
                         "(it must hold one plain directory name); pass tag= (--tag on the "
                         "command line)") from None


def resolve_tag(save_dir, tag=None) -> str:
    """The tag directory to read: `tag`, or the one named in <save_dir>/latest.
    A tag whose replacement by a save was cut short between its two
    renames (or is between them now) is read from where its previous
    checkpoint waits."""
    try:
        save_dir = os.fspath(save_dir)
    except TypeError:
        raise TypeError(f"the checkpoint directory must be a path, got "
                        f"{type(save_dir).__name__} {save_dir!r}") from None
    if not os.path.isdir(save_dir):
        what = " (a file of that name does; give the directory save_checkpoint wrote)" \
            if os.path.isfile(save_dir) else ""
        raise FileNotFoundError(f"checkpoint directory {save_dir!r} does not exist{what}")
    tag = _latest_tag(save_dir) if tag is None else check_tag(tag)
    path = os.path.join(save_dir, tag)
    if not os.path.lexists(path) and \
            os.path.isfile(os.path.join(replaced_directory(save_dir, tag), META_FILE)):
        path = replaced_directory(save_dir, tag)
    if os.path.lexists(path) and not inside(save_dir, path):
        raise ValueError(f"{path!r} is a link to a directory outside {save_dir!r}; a "
                         "checkpoint is read from inside its directory only")
    if not os.path.isfile(os.path.join(path, META_FILE)):
        if holds_deepspeed_files(path):
            raise FileNotFoundError(deepspeed_refusal(save_dir))
        hint = tag_directory_hint(save_dir)
        raise FileNotFoundError(f"{path!r} holds no zero checkpoint ({META_FILE} is missing)"
                                + (f"; {hint}" if hint else ""))
    return path


# ---- checks of a file's structure: a damaged file is refused by name, before
# anything is read from it (and before a loading engine changes) ----------------


def _damaged(file, what) -> ValueError:
    return ValueError(f"checkpoint file {file!r} is damaged: {what}; load another checkpoint")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(obj, key, kinds, file, where):
    """obj[key], which must be one of `kinds` (int excluding bool)."""
    if not isinstance(obj, dict):
        raise _damaged(file, f"{where} is a {type(obj).__name__}, not a dict")
    if key not in obj:
        raise _damaged(file, f"{where} has no {key!r}")
    value = obj[key]
    if not isinstance(value, kinds) or (kinds is int and isinstance(value, bool)):
        raise _damaged(file, f"{where}[{key!r}] is a {type(value).__name__}")
    return value


def _check_header(obj, file):
    """Nothing of a file that is not zero's is quoted: it may hold anything."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"{file!r} is not a zero checkpoint file (it has no {FORMAT!r} "
                         "header)")
    if obj.get("version") != VERSION:
        raise ValueError(f"{file!r} has checkpoint version {obj.get('version')!r:.40}; this "
                         f"zero reads version {VERSION!r}")


def _check_params(params, file):
    for name, info in params.items():
        where = f"params[{name!r}]"
        shape = _field(info, "shape", (list, tuple), file, where)
        numel = _field(info, "numel", int, file, where)
        _field(info, "trainable", bool, file, where)
        if not all(_is_int(n) and n >= 0 for n in shape) or \
                numel != torch.Size(shape).numel():
            raise _damaged(file, f"{where} has shape {shape!r} and numel {numel!r}")


def _check_names(names, params, file, where):
    if not all(isinstance(n, str) and n in params for n in names):
        raise _damaged(file, f"{where} names a parameter not in its 'params'")


def _state_entry_ok(entry, params, buffers, extra_states) -> bool:
    """(key, "param", parameter name), (key, "buffer", None) or (key,
    "extra_state", None)."""
    if not isinstance(entry, (list, tuple)) or len(entry) != 3 or \
            not all(isinstance(s, str) for s in entry[:2]):
        return False
    key, kind, name = entry
    return kind == "param" and isinstance(name, str) and name in params or \
        kind == "buffer" and key in buffers or kind == "extra_state" and key in extra_states


def _check_meta(meta, file):
    """What load and consolidate read from the meta is there, of its type."""
    top = "the meta"
    params = _field(meta, "params", dict, file, top)
    _check_params(params, file)
    # plain names: a shard is read from the tag directory only
    for key in ("shards", "client_states") if "client_states" in meta else ("shards",):
        if not all(isinstance(f, str) and f not in ("", ".", "..") and
                   os.path.basename(f) == f for f in _field(meta, key, list, file, top)):
            raise _damaged(file, f"its {key!r} is not a list of file names")
    buffers = _field(meta, "buffers", dict, file, top)
    for key, t in buffers.items():
        _check_record(t, file, f"buffers[{key!r}]", floating=False)
    # [Note: extra state] in _extra_states.py; none before it was kept
    extra_states = _field(meta, "extra_states", dict, file, top) if "extra_states" in meta \
        else {}
    for i, entry in enumerate(_field(meta, "state_dict", list, file, top)):
        if not _state_entry_ok(entry, params, buffers, extra_states):
            raise _damaged(file, f"state_dict[{i}] is {entry!r}")
    for gi, group in enumerate(_field(meta, "groups", list, file, top)):
        where = f"groups[{gi}]"
        _check_names(_field(group, "param_names", list, file, where), params, file, where)
        _field(group, "hyper", dict, file, where)
        _field(group, "step", int, file, where)
        if not all(isinstance(state, str) for state in _field(group, "states", list, file, where)):
            raise _damaged(file, f"{where}['states'] is not a list of state names")
    engine = _field(meta, "engine", dict, file, top)
    for key in ("micro_steps", "global_steps"):
        _field(engine, key, int, file, "its 'engine'")
    for key in ("optimizer", "optimizer_class"):
        _field(meta, key, str, file, top)
    if meta["optimizer"] not in SPECS:
        raise _damaged(file, f"{top}['optimizer'] names no optimizer zero knows "
                             f"(one of {sorted(SPECS)})")
    _field(meta, "loss_scaler", (dict, type(None)), file, top)
    _field(meta, "lr_scheduler", (dict, type(None)), file, top)
    _field(meta, "client_state", object, file, top)


def _dense_strides(t) -> bool:
    """Whether t's elements sit one after another in some order of its
    dimensions (contiguous up to a permutation, as torch.save keeps a
    transposed buffer): no element shared, none skipped. An empty tensor
    has no elements to place (torch gives empty(3, 0) strides (1, 1))."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _check_record(t, file, where, floating: bool):
    """A tensor as zero's save writes one: dense (strided), its elements
    dense within its storage; real floating point for partition tensors
    (`floating`). A sparse or quantized tensor passed
    the name and shape checks and failed inside copy_() after weights were
    already overwritten."""
    if not isinstance(t, torch.Tensor):
        raise _damaged(file, f"{where} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided or t.is_quantized or getattr(t, "is_nested", False):
        raise _damaged(file, f"{where} is a {t.layout} tensor{' (quantized)' * t.is_quantized}"
                       "; a checkpoint holds dense (strided) tensors only")
    # a buffer may be of any dtype (a complex table of rotary frequencies);
    # _check_buffers compares it with the model's
    if floating and (t.is_complex() or not t.is_floating_point()):
        raise _damaged(file, f"{where} has dtype {t.dtype}; partitions are real floating "
                       "point")
    if not _dense_strides(t):
        raise _damaged(file, f"{where} has shape {tuple(t.shape)} and strides {t.stride()}, "
                       "which skip or share elements")
    if t.numel() and t.storage_offset() + t.numel() > \
            t.untyped_storage().nbytes() // t.element_size():
        raise _damaged(file, f"{where} has {t.numel()} elements from offset "
                       f"{t.storage_offset()} in a storage of "
                       f"{t.untyped_storage().nbytes()} bytes")


def _check_tensors(group, file, where) -> dict:
    """The group's partition tensors: 1-D, one per key, contiguous floats."""
    tensors = _field(group, "tensors", dict, file, where)
    for key, t in tensors.items():
        if not isinstance(key, str) or not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise _damaged(file, f"{where}['tensors'][{key!r}] is not a 1-D tensor")
        _check_record(t, file, f"{where}['tensors'][{key!r}]", floating=True)
    return tensors


def _check_piece(piece, params, size, file, where):
    """(name, lo, hi, offset): elements [lo, hi) of a parameter the meta
    names, within the `size` elements of every tensor of its group."""
    def bad(why):
        return _damaged(file, f"{where} piece {piece!r} {why}")
    if not isinstance(piece, (list, tuple)) or len(piece) != 4:
        raise bad("is not (name, lo, hi, offset)")
    name, lo, hi, offset = piece
    if not isinstance(name, str) or name not in params:
        raise bad(f"names no parameter of {META_FILE}")
    if not all(_is_int(v) for v in (lo, hi, offset)):
        raise bad("has a bound that is not an integer")
    if not 0 <= lo < hi <= params[name]["numel"]:
        raise bad(f"is not a stretch of the parameter's {params[name]['numel']} elements")
    if offset < 0 or offset + (hi - lo) > size:
        raise bad(f"runs outside its group's tensors ({size} elements)")
    return name, lo, hi, offset


def _overlapping(spans):
    """The labels of two of the (start, end, label) spans that overlap, or
    None."""
    ordered = sorted(spans, key=lambda span: span[:2])
    for (_start, end, first), (start, _end, second) in zip(ordered, ordered[1:]):
        if start < end:
            return first, second
    return None


def _stretch(source, start, n, file):
    """source[start:start + n], whole: a slice would silently come out
    shorter where the file's table of pieces points past the tensor."""
    if start < 0 or start + n > source.numel():
        raise _damaged(file, f"a piece runs outside its tensor of {source.numel()} elements")
    return source.narrow(0, start, n)


class CheckpointReader:
    """Reads any stretch of any parameter's value or optimizer state from a
    checkpoint directory, whatever world size and stage wrote it. Shard
    files are memory-mapped: only the stretches asked for are read. Every
    file's structure and every piece is checked when it is opened, so a
    damaged file is refused before anything is read from it."""

    def __init__(self, path: str):
        self.path = path
        # the checkpoint directory (resolve_tag's save_dir): no file is
        # read from outside it, through a link either
        self.root = os.path.dirname(os.path.abspath(path))
        meta_file = os.path.join(path, META_FILE)
        self.meta = self._load(META_FILE)
        _check_header(self.meta, meta_file)
        self._verified = set()  # files whose bytes matched their checksums
        self.verify(meta_file)
        _check_meta(self.meta, meta_file)
        self.index = defaultdict(list)  # name -> [(lo, hi, tensors, offset, file)]
        self._mapped_tensors = None  # drop_pages's, made once
        for file in self.meta["shards"]:
            self._add_shard(file)
        self._check_overlaps()

    def read_file(self, file, mmap=False) -> dict:
        """One of the save's files besides the meta, checked to be zero's
        and of the same save."""
        full = os.path.join(self.path, file)
        obj = self._load(file, mmap=mmap)
        _check_header(obj, full)
        if obj.get("save_id") != self.meta.get("save_id"):
            raise ValueError(f"{full!r} belongs to another save than {META_FILE} (a save into "
                             "this tag that did not finish?); load another checkpoint")
        return obj

    def _add_shard(self, file):
        full = os.path.join(self.path, file)
        shard = self.read_file(file, mmap=True)
        params = self.meta["params"]
        for gi, group in enumerate(_field(shard, "groups", list, full, "the shard")):
            where = f"groups[{gi}]"
            tensors = _check_tensors(group, full, where)
            size = min((t.numel() for t in tensors.values()), default=0)
            pieces = [_check_piece(piece, params, size, full, where)
                      for piece in _field(group, "pieces", list, full, where)]
            # two pieces stored in the same elements: one parameter would
            # load another's values
            shared = _overlapping((p[3], p[3] + p[2] - p[1], p) for p in pieces)
            if shared:
                raise _damaged(full, f"{where} pieces {shared[0]!r} and {shared[1]!r} are "
                               "stored in the same elements")
            for name, lo, hi, offset in pieces:
                self.index[name].append((lo, hi, tensors, offset, full))

    def _check_overlaps(self):
        """Two pieces holding the same elements of one state would make the
        value read depend on the order of the files."""
        for name, pieces in self.index.items():
            for key in {key for piece in pieces for key in piece[2]}:
                shared = _overlapping((lo, hi, (file, lo, hi)) for lo, hi, tensors, _o, file
                                      in pieces if key in tensors)
                if shared:
                    (_f, lo, hi), (file, lo2, hi2) = shared
                    raise _damaged(file, f"its piece of '{name}' elements [{lo2}, {hi2}) "
                                   f"overlaps another piece's [{lo}, {hi}) of {key!r}")

    def _load(self, file, mmap=False):
        full = os.path.join(self.path, file)
        if not os.path.lexists(full):
            raise FileNotFoundError(f"checkpoint file {full!r} is missing (every rank's shard "
                                    "must be readable from every loading rank)")
        if not inside(self.root, full):
            raise ValueError(f"checkpoint file {full!r} is a link to a file outside "
                             f"{self.root!r}; a checkpoint is read from inside its directory "
                             "only")
        if not os.path.isfile(full):
            raise ValueError(f"checkpoint file {full!r} is not a regular file")
        try:
            is_archive = zipfile.is_zipfile(full)
        except zipfile.BadZipFile as error:  # found an end record, but a damaged one
            raise unreadable(full, error) from None
        if not is_archive:
            raise not_an_archive(full)
        try:
            # before torch.load: a storage larger than its record reads
            # other bytes through mmap, and is what a loader allocates
            mismatch = storage_size_mismatch(full)
        except ValueError as error:
            raise unreadable(full, error) from None
        if mismatch:
            raise _damaged(full, mismatch)
        try:
            return torch.load(full, map_location="cpu", weights_only=True, mmap=mmap)
        # the weights-only unpickler raises KeyError, IndexError or
        # TypeError on damaged pickle bytes (a memo index, an empty stack)
        except (RuntimeError, OSError, EOFError, ValueError, KeyError, IndexError, TypeError,
                pickle.UnpicklingError) as error:
            if holds_code(full, error):
                raise runs_code(full) from None
            raise unreadable(full, error) from None

    def verify(self, file):
        """Refuse a file whose bytes differ from the CRC-32 torch.save wrote
        for each record (_zip_checksums.py): a changed byte in a tensor's
        data loaded as a wrong number. A shard is checked the first time a
        stretch is read from it (engine.load_checkpoint reads every stretch
        it will load in its checks, before anything changes)."""
        if file in self._verified:
            return
        record = damaged_record(file)
        if record is not None:
            raise ValueError(f"checkpoint file {file!r} is damaged: its record {record!r} does "
                             "not match the CRC-32 torch.save wrote for it (a byte changed on "
                             "the disk or in a copy); load another checkpoint")
        self._verified.add(file)

    def has_state(self, name: str, key: str) -> bool:
        pieces = self.index.get(name)
        if not pieces:
            # a parameter of no elements lies in no shard: no states to read
            info = self.meta["params"].get(name)
            return info is not None and info["numel"] == 0
        return all(key in piece[2] for piece in pieces)

    def _stretches(self, name: str, key: str, lo: int, hi: int):
        """(a, b, source) for each stored stretch [a, b) of [lo, hi); raises
        unless together they cover it."""
        found, covered = [], 0
        for p_lo, p_hi, tensors, offset, file in self.index.get(name, ()):
            a, b = max(lo, p_lo), min(hi, p_hi)
            if a >= b:
                continue
            if key not in tensors:
                raise ValueError(f"checkpoint file {file!r} has no {key!r} for parameter "
                                 f"'{name}'; load another checkpoint")
            self.verify(file)
            found.append((a, b, _stretch(tensors[key], offset + a - p_lo, b - a, file)))
            covered += b - a
        if covered != hi - lo:
            raise ValueError(f"the checkpoint holds {covered} of elements [{lo}, {hi}) of "
                             f"'{name}' {key!r}: a shard file is missing or damaged")
        return found

    def check(self, name: str, key: str, lo: int, n: int):
        """Raise unless elements [lo, lo + n) of `name`'s `key` are stored."""
        self._stretches(name, key, lo, lo + n)

    def file_mappings(self) -> list:
        """Where this process maps the shard files (for drop_pages)."""
        return file_mappings({piece[4] for pieces in self.index.values() for piece in pieces})

    def drop_pages(self, mappings):
        """Unmap the pages of the shard files read so far (loaded with
        mmap=True: they read back from the files if needed again), so that
        loading a checkpoint larger than memory holds no more than what is
        being copied. mappings: file_mappings()."""
        if self._mapped_tensors is None:  # the index does not change
            seen, self._mapped_tensors = set(), []
            for pieces in self.index.values():
                for _lo, _hi, tensors, _offset, _file in pieces:
                    for t in tensors.values():
                        if id(t) not in seen:
                            seen.add(id(t))
                            self._mapped_tensors.append(t)
        for t in self._mapped_tensors:
            drop_file_mapped_pages(t, mappings)

    def read_into(self, name: str, key: str, lo: int, out: torch.Tensor):
        """out (1-D, any dtype and device) = elements [lo, lo + out.numel())
        of the flattened `name`'s `key` ("value" or a state name)."""
        for a, b, source in self._stretches(name, key, lo, lo + out.numel()):
            out[a - lo:b - lo].copy_(source)

    def read(self, name: str, key: str = "value") -> torch.Tensor:
        """The whole parameter's `key`, fp32, in its shape. Its size is the
        meta's word, so the files must hold every element before the
        memory is taken (a meta declaring 2**36 elements asked for 256 GiB)."""
        info = self.meta["params"][name]
        stretches = self._stretches(name, key, 0, info["numel"])
        out = torch.empty(info["numel"], dtype=torch.float32)
        for a, b, source in stretches:
            out[a:b].copy_(source)
        return out.view(info["shape"])

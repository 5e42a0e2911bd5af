"""Checking each tensor storage of a torch.save file against the record
that holds its bytes, without running the file's pickle.

torch.save writes one record per storage, and the pickle names each one
by a persistent id ("storage", type, key, location, element count). With
`torch.load(mmap=True)` the storage is a window of that many bytes from
the record's start: a record shorter than its declared size (an edited or
crafted file) then reads the bytes of whatever follows it in the file, or
past the file's end, and its CRC-32 covers only the record's own bytes.
A declared size is also what a loader allocates. So the sizes are checked
against the records first, by walking the pickle's opcodes on a model of
its stack (pickletools), never by unpickling it.
"""
from __future__ import annotations

import os
import pickletools
import struct
import warnings
import zipfile
import zlib

import torch

from zero.checkpoint._zip_checksums import LOCAL_HEADER_SIZE, data_start

_MARK = object()  # the stack's MARK
_OPAQUE = object()  # a value this walk does not model (a dict, a call's result)

_STRING_OPS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
               "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8"}
_INT_OPS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}
_TUPLE_SIZES = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}


class _Walk:
    """The stack and memo of an unpickling, with strings, integers,
    globals and tuples of them kept as values and everything else opaque."""

    def __init__(self):
        self.stack, self.memo, self.persistent_ids = [], {}, []

    def pop(self):
        if not self.stack or self.stack[-1] is _MARK:
            raise ValueError("the pickle pops from an empty stack")
        return self.stack.pop()

    def pop_to_mark(self) -> list:
        if _MARK not in self.stack:
            raise ValueError("the pickle has no MARK where one is needed")
        at = len(self.stack) - 1 - self.stack[::-1].index(_MARK)
        items = self.stack[at + 1:]
        del self.stack[at:]
        return items

    def step(self, op, arg):
        name = op.name
        if name in _STRING_OPS or name in _INT_OPS:
            self.stack.append(arg)
        elif name == "MARK":
            self.stack.append(_MARK)
        elif name == "GLOBAL":
            self.stack.append(("global",) + tuple(arg.split(" ", 1)))
        elif name == "STACK_GLOBAL":
            attr, module = self.pop(), self.pop()
            self.stack.append(("global", module, attr))
        elif name == "TUPLE":
            self.stack.append(tuple(self.pop_to_mark()))
        elif name in _TUPLE_SIZES:
            items = [self.pop() for _ in range(_TUPLE_SIZES[name])]
            self.stack.append(tuple(reversed(items)))
        elif name in _PUT_OPS or name == "MEMOIZE":
            if not self.stack:
                raise ValueError("the pickle memoizes from an empty stack")
            self.memo[len(self.memo) if name == "MEMOIZE" else arg] = self.stack[-1]
        elif name in _GET_OPS:
            if arg not in self.memo:
                raise ValueError(f"the pickle reads memo entry {arg}, never written")
            self.stack.append(self.memo[arg])
        elif name == "BINPERSID":
            self.persistent_ids.append(self.pop())
            self.stack.append(_OPAQUE)
        elif name == "DUP":
            self.stack.append(self.stack[-1] if self.stack else self.pop())
        else:  # by the opcode's stack effect, values opaque
            before = list(op.stack_before)
            if pickletools.markobject in before:
                self.pop_to_mark()
                before = before[:before.index(pickletools.markobject)]
            for _ in before:
                self.pop()
            self.stack.extend(_OPAQUE for _ in op.stack_after)


def _element_size(storage_type) -> int:
    """Bytes per element of a persistent id's storage class (torch.FloatStorage
    and its kin, torch.UntypedStorage)."""
    if not (isinstance(storage_type, tuple) and len(storage_type) == 3 and
            storage_type[1] in ("torch", "torch.storage") and
            isinstance(storage_type[2], str) and storage_type[2].endswith("Storage")):
        raise ValueError(f"a storage's type is {storage_type!r}, not one of torch's")
    # torch.save names float8, uint16-64 and complex32 storages untyped:
    # GLOBAL 'torch.storage UntypedStorage', sized in bytes
    if storage_type[2] == "UntypedStorage":
        return 1
    if storage_type[1] != "torch":
        raise ValueError(f"a storage's type is {storage_type!r}, not one of torch's")
    cls = getattr(torch, storage_type[2], None)
    with warnings.catch_warnings():  # TypedStorage's deprecation notice
        warnings.simplefilter("ignore")
        dtype = getattr(cls, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a storage's type torch.{storage_type[2]} is not a storage class")
    return torch.empty(0, dtype=dtype).element_size()


def declared_storages(pickle_bytes: bytes) -> list:
    """(key, bytes) for each storage the pickle names, as torch.save's
    persistent ids declare them."""
    walk = _Walk()
    try:
        for op, arg, _pos in pickletools.genops(pickle_bytes):
            walk.step(op, arg)
    except (ValueError, struct.error, EOFError, IndexError) as error:
        raise ValueError(f"its pickle cannot be walked ({error})") from error
    out = []
    for pid in walk.persistent_ids:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ValueError("a persistent id is not torch.save's ('storage', type, key, "
                             "location, size)")
        _tag, storage_type, key, _location, numel = pid
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise ValueError("a storage's key or size is not of torch.save's form")
        out.append((key, numel * _element_size(storage_type)))
    return out


def storage_size_mismatch(path: str):
    """A sentence saying which storage of the torch.save file at `path` is
    not exactly the size of its record, or None when all are. Raises
    ValueError when the file is not a torch.save archive this can read."""
    try:
        with zipfile.ZipFile(path) as archive:
            records = {info.filename: info for info in archive.infolist()}
            pickles = [name for name in records if name.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise ValueError("it does not hold exactly one data.pkl")
            prefix = pickles[0][:-len("data.pkl")]
            if records[pickles[0]].file_size > 1 << 30:
                raise ValueError("its data.pkl is larger than 1 GiB")
            declared = declared_storages(archive.read(pickles[0]))
    # unknown compression (NotImplementedError), an encrypted record
    # (RuntimeError), a damaged deflate stream (zlib.error)
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, NotImplementedError,
            RuntimeError, zlib.error) as error:
        raise ValueError(f"it is not a readable torch.save archive ({error})") from error
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        for key, nbytes in declared:
            info = records.get(f"{prefix}data/{key}")
            if info is None:
                return f"storage {key!r} has no record"
            if info.file_size != nbytes:
                return (f"storage {key!r} declares {nbytes} bytes but its record holds "
                        f"{info.file_size}")
            f.seek(info.header_offset)
            start = data_start(f.read(LOCAL_HEADER_SIZE), info)
            if start is None or info.compress_type != zipfile.ZIP_STORED or \
                    start + nbytes > file_size:
                return f"storage {key!r}'s record is not stored whole within the file"
    return None

"""Checking a torch.save file against the CRC-32 torch wrote into it.

torch.save writes a zip archive, one stored (uncompressed) record per
tensor storage plus the pickle, and the zip format makes it record each
record's CRC-32; torch.load never checks them (nor does its mmap path). A
flipped bit in a checkpoint's data then loads as a wrong number. Checking
them costs nothing at save time and one pass of zlib.crc32 over the bytes
at load (which zlib runs without the GIL), through a read-only mapping of
the file, so nothing is copied.
"""
from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor

_LOCAL_HEADER = b"PK\x03\x04"
LOCAL_HEADER_SIZE = 30
_SLICE = 1 << 23  # bytes per zlib.crc32 call: bounded, so a huge record is fine too


def _crc32(view, mapped=None, base=0) -> int:
    """CRC-32 of view; with `mapped` (the file's mapping, view starting at
    byte `base` of it), each slice's pages are unmapped once summed, so
    checking a file larger than memory holds one slice of it."""
    crc = 0
    for lo in range(0, len(view), _SLICE):
        crc = zlib.crc32(view[lo:lo + _SLICE], crc)
        if mapped is not None:
            start = (base + lo) // mmap.PAGESIZE * mmap.PAGESIZE
            end = min(base + lo + _SLICE, len(mapped))
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
    return crc


def damaged_record(path: str):
    """The name of the first record of the torch.save file at `path` whose
    bytes do not match its CRC-32, or None when all do. Raises ValueError
    when the file is not a readable zip archive."""
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
            records = archive.infolist()
            if not records:
                return None
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    # one thread a record (a shard holds one per state):
                    # zlib.crc32 runs without the GIL
                    workers = min(len(records), len(os.sched_getaffinity(0)))
                    with ThreadPoolExecutor(workers) as pool:
                        ok = list(pool.map(lambda info: _record_ok(archive, view, info, mapped),
                                           records))
                finally:
                    view.release()  # before the mapping closes
        for info, good in zip(records, ok):
            if not good:
                return info.filename
    except (zipfile.BadZipFile, OSError, ValueError, struct.error) as error:
        raise ValueError(f"{path!r} is not a readable torch.save archive ({error})") from error
    return None


_DOS_DIRECTORY = 0x10  # the external attributes' MS-DOS directory bit
_ENCRYPTED = 0x1       # general purpose flag bit 0


def _record_ok(archive, view, info, mapped=None) -> bool:
    # torch.load's reader (miniz) takes a record marked a directory (the
    # DOS bit, or a name ending in '/') for one and never fills its
    # storage, and zipfile, which checks the CRC here, ignores the mark:
    # one flipped bit loaded zeros or freed memory as a tensor. torch
    # writes neither mark, nor encrypted records
    if info.external_attr & _DOS_DIRECTORY or info.filename.endswith("/") or \
            info.flag_bits & _ENCRYPTED:
        return False
    if info.compress_type != zipfile.ZIP_STORED:
        # not what torch writes; zipfile checks the CRC as it inflates
        try:
            with archive.open(info) as record:
                while record.read(_SLICE):
                    pass
        except zipfile.BadZipFile:
            return False
        return True
    start = data_start(bytes(view[info.header_offset:info.header_offset + LOCAL_HEADER_SIZE]),
                       info)
    if start is None or start + info.file_size > len(view):
        return False
    return _crc32(view[start:start + info.file_size], mapped, start) == info.CRC


def data_start(header: bytes, info):
    """Where the stored record `info` starts in its file, given the
    LOCAL_HEADER_SIZE bytes at info.header_offset; None when they are not
    a local header."""
    if len(header) != LOCAL_HEADER_SIZE or header[:4] != _LOCAL_HEADER:
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + LOCAL_HEADER_SIZE + name_len + extra_len

"""A tensor whose bytes live in a file rather than in the process's memory:
an unlinked file on the offload disk, mapped shared, whose pages are
dropped from the process after each use so that only what is being
touched is resident.

Used where a whole tensor must exist but need not be in RAM:
partitioned_init's chunks with `nvme_path` (a model built larger than the
machine's memory), and close() of an engine whose parameters lived in
files (the model handed back file-backed). The file descriptor is closed
at once: the mapping keeps the file, and the file's space returns when the
last tensor viewing the mapping is freed (the file was unlinked at birth,
so it goes with the process after a crash too).
"""
from __future__ import annotations

import errno
import mmap
import os
import uuid

import torch


class MappedFile:
    def __init__(self, directory: str, numel: int, dtype: torch.dtype, what: str):
        """A file of numel zeros of dtype in `directory`; `what` names the
        setting the directory came from, for errors."""
        self.itemsize = dtype.itemsize
        nbytes = max(1, numel * dtype.itemsize)  # mmap refuses an empty file
        path = os.path.join(directory, f"zero-{os.getpid()}-{uuid.uuid4().hex}.mapped")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise OSError(e.errno, f"{what} {directory!r}: cannot create a file there: "
                                   f"{e.strerror}") from None
        try:
            os.unlink(path)
            try:  # the blocks now: a full disk fails here, not at a later page fault
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                problem = "has no room for" if e.errno == errno.ENOSPC else "cannot reserve"
                raise OSError(e.errno, f"{what} {directory!r} {problem} {nbytes:,} bytes: "
                                       f"{e.strerror}") from None
            self.map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.map, dtype=dtype, count=numel) if numel else \
            torch.empty(0, dtype=dtype)

    def drop(self, lo: int = 0, hi: int | None = None):
        """Take elements [lo, hi) (default all) out of the process's resident
        memory; their values stay in the file (a shared mapping's dropped
        page is read back from it). Widened to whole pages, harmlessly."""
        end = self.tensor.numel() if hi is None else hi
        start = lo * self.itemsize // mmap.PAGESIZE * mmap.PAGESIZE
        length = min(end * self.itemsize, len(self.map)) - start
        if length > 0:
            self.map.madvise(mmap.MADV_DONTNEED, start, length)



def _malloc_trim():
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_trim = _malloc_trim()


def release_freed_memory():
    """Return the C heap's freed blocks to the system (glibc's malloc_trim).

    Why: glibc serves a block below its mmap threshold from the heap, and
    the threshold rises to 32 MiB after the first large block is freed. So
    building or laying out a model one parameter at a time (allocate its
    full values, cut them to a file, free them) kept every freed block
    resident: a 0.3B fp32 model built under partitioned_init(nvme_path=)
    held 0.9 GiB of freed heap, the whole model, until a trim. Called where
    a model on a disk frees one full tensor after another."""
    if _trim is not None:
        _trim(0)

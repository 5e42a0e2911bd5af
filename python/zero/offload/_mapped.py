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

import ctypes
import errno
import mmap
import os
import threading
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


class PagesDroppedMeanwhile:
    """While inside: `drop()` every `every` seconds on a thread of its own.

    Why: torch.save and torch.load read and write a tensor in one call
    (with the GIL released), so a mapped file's pages brought in by that
    call stay resident until it returns: saving the fp32 master and Adam
    moments of a 0.3B model from their files held 1.1x the model states,
    loading them 2x. Dropping the mappings' pages meanwhile (madvise
    MADV_DONTNEED: the values stay in the files, a page read again comes
    back from them) keeps the resident part to what the call touches
    between two drops."""

    def __init__(self, drop, every: float = 0.02):
        self._drop, self._every = drop, every
        self._done = threading.Event()
        self._thread = None

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, name="zero-drop-pages", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._done.wait(self._every):
            self._drop()

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self._drop()
        return False


_MADV_DONTNEED = 4  # Linux


def file_mappings(paths) -> list:
    """(start, end) of this process's mappings of the files `paths`, from
    /proc/self/maps."""
    real = {os.path.realpath(p) for p in paths}
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() in real:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def drop_file_mapped_pages(tensor: torch.Tensor, mappings):
    """Unmap from the process the whole pages inside `tensor`'s storage,
    when the storage lies wholly inside one of `mappings` (file_mappings of
    files mapped private and never written, or shared: torch.load(mmap=True)
    maps its file so). A dropped page of a file mapping reads back from the
    file; anonymous memory would read back as zeros, which is why a storage
    outside the mappings is left alone."""
    if _libc is None:
        return
    storage = tensor.untyped_storage()
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    if not any(a <= lo and hi <= b for a, b in mappings):
        return
    start = -(-storage.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (storage.data_ptr() + storage.nbytes()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _load_libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_libc = _load_libc()

"""Optimizer states kept in files on a fast disk (offload_optimizer
device "nvme"): each offloaded tensor (the fp32 master, when it is not the
parameters themselves, and every optimizer state) is a file. The file is
also mapped into memory, so the rest of the engine (checkpoints,
full_state_dict, a reset) sees an ordinary CPU tensor; those whole-tensor
uses drop the mapped pages again when done (FlatGroup.release_offloaded).

[Note: offloaded step] The step never touches the mapping. It walks the
partition in chunks through a few RAM windows (SLOTS per file): while the
C core updates chunk i in one window, the C core's I/O engine reads chunk
i+1 into the next window and writes chunk i-1 back from the previous one
([Note: disk I/O] in _aio.py). Reads, writes and the update overlap; a
window is reused only after its write has finished. The windows are the
only offloaded bytes the process holds: SLOTS x chunk x 4 bytes per file
(fewer windows when the partition has fewer chunks). Explicit reads and
writes beat faulting the mapping chunk by chunk (one fault a page, about
1.7x slower in bench/offload.py's measurements) and keep the process's
memory at the windows whatever the kernel does.

[Note: direct I/O] write_through files can also be read and written with
O_DIRECT (_aio.set_io(direct=True)): each such file has a second, O_DIRECT
descriptor where its filesystem allows it (tmpfs before Linux 6.6 and some
FUSE filesystems refuse it, and there the buffered one serves). The disk
then moves the windows' pages itself, with no copy through the page cache
and nothing left in it to evict. It is off by default because on the
machine this was measured on (a virtual disk) buffered transfers were
faster: the page cache's readahead reads in larger requests
(docs/offload.md, "Disk I/O"). O_DIRECT wants page-aligned memory,
offsets and lengths, so the windows are anonymous mappings (page-aligned)
rounded up to whole pages, chunks start on page boundaries, and every
file is reserved to a whole number of pages, so a partition's last,
partial page moves whole (the bytes past its end are never read as
values). Direct transfers and the mapping stay coherent because they
never overlap in time: the kernel writes a range's dirty pages before a
direct read of it and drops its cached pages after a direct write, and
nothing writes through the mapping while a step runs.

[Note: write-through] By default what the step writes stays in the page
cache (memory the kernel may reclaim, which the process does not hold),
so with RAM to spare the next step reads it from memory. write_through
=True also starts each written chunk's writeback and evicts it from the
page cache (POSIX_FADV_DONTNEED: on Linux it starts writeback of dirty
pages and drops clean ones), so the states take neither process nor
cache memory and every step reads and writes them on the disk: the
behaviour of DeepSpeed's NVMe offload. Pages still being written when a
chunk is dropped stay cached; they are dropped again when its window is
reused, and at the end of the step, after fdatasync has waited for the
last writes, so a step returns with every state on the disk and none
cached.

The files are unlinked as soon as they are created: they vanish with the
process, even after a crash, and their space returns when the engine is
garbage collected.
"""
from __future__ import annotations

import errno
import mmap
import os
import uuid

import torch

import zero.offload._aio as _aio
from zero.offload._aio import Transfers

PAGE_ELEMENTS = mmap.PAGESIZE // 4  # fp32 elements per page
SLOTS = 3  # windows per file: being read, being updated, being written
# O_DIRECT (0 where the platform has none: the buffered descriptor serves)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def whole_pages(nbytes: int) -> int:
    """Bytes a file of nbytes takes: whole pages (each file is reserved
    so, and the filesystem gives no less)."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def window_elements(elements: int) -> int:
    """The fp32 elements a step window of `elements` takes: whole pages."""
    return -(-elements // PAGE_ELEMENTS) * PAGE_ELEMENTS


class NvmeFiles:
    """The offload files of one flat group on one rank."""

    def __init__(self, directory: str, label: str, chunk_elements: int,
                 write_through: bool = False, what: str = "offload_optimizer"):
        self.directory = directory
        self.label = label
        self.what = what  # the config block, for messages: offload_optimizer or offload_param
        # chunks start on page boundaries, so whole pages are dropped
        self.chunk = max(PAGE_ELEMENTS, chunk_elements // PAGE_ELEMENTS * PAGE_ELEMENTS)
        self.write_through = write_through
        self.maps: dict[str, mmap.mmap] = {}
        self.itemsize: dict[str, int] = {}  # fp32 but for offload_param's shard
        self.fds: dict[str, int] | None = {}  # None once closed
        # O_DIRECT descriptors of write_through files where the filesystem
        # allows it, else the same as fds' ([Note: direct I/O])
        self.io_fds: dict[str, int] = {}
        self.pid = os.getpid()
        self.nbytes = 0
        self._windows = None  # SLOTS dicts name -> fp32 tensor, made at the first step
        self._io = Transfers(what, directory)

    def __del__(self):
        if getattr(self, "fds", None):
            self.close()

    def create(self, name: str, numel: int, fill: float = 0.0,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A file of numel elements of dtype, all `fill`; returns its
        mapping. Only fp32 files take part in paged_update."""
        if numel == 0:  # nothing to keep (a group of empty parameters)
            return torch.empty(0, dtype=dtype)
        nbytes = numel * dtype.itemsize
        # a name no other process takes: the pid alone met a leftover of a
        # process killed between creation and unlink whose pid came back (a
        # restarted container), or another container's in a shared directory
        path = os.path.join(self.directory,
                            f"zero-{os.getpid()}-{uuid.uuid4().hex}-{self.label}-{name}.states")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise OSError(e.errno, f"{self.what}.nvme_path {self.directory!r}: cannot "
                                   f"create a file for '{name}': {e.strerror}") from None
        io_fd = fd
        try:
            if self.write_through and _O_DIRECT:
                try:
                    io_fd = os.open(path, os.O_RDWR | _O_DIRECT)
                except OSError:  # this filesystem has no O_DIRECT: buffered
                    pass
            os.unlink(path)
            try:  # the blocks now, so a full disk fails here and not mid-step
                # (whole pages: the last one moves whole, [Note: direct I/O])
                os.posix_fallocate(fd, 0, whole_pages(nbytes))
            except OSError as e:
                problem = "has no room for" if e.errno == errno.ENOSPC else "cannot reserve"
                raise OSError(e.errno, f"{self.what}.nvme_path {self.directory!r} "
                                       f"{problem} {nbytes:,} bytes of '{name}': "
                                       f"{e.strerror}") from None
            try:
                mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                raise OSError(e.errno, f"{self.what}.nvme_path {self.directory!r}: "
                                       f"cannot map the file of '{name}': {e.strerror}") \
                    from None
            tensor = torch.frombuffer(mapped, dtype=dtype, count=numel)
        except BaseException:
            os.close(fd)
            if io_fd != fd:
                os.close(io_fd)
            raise
        self.maps[name] = mapped
        self.itemsize[name] = dtype.itemsize
        self.fds[name] = fd
        self.io_fds[name] = io_fd
        # what the disk holds: whole pages ([Note: disk room] sums these)
        self.nbytes += whole_pages(nbytes)
        if fill != 0.0:  # fallocate gave zeros
            for lo, hi in self.chunks(numel):
                tensor[lo:hi].fill_(fill)
                self.drop(name, lo, hi)
        return tensor

    def write(self, name: str, tensor: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Copy `source` into the mapping `tensor` of file `name` a chunk at
        a time, holding at most one chunk of it in RAM."""
        for lo, hi in self.chunks(source.numel()):
            tensor[lo:hi].copy_(source[lo:hi])
            self.drop(name, lo, hi)
        return tensor

    def chunks(self, numel: int):
        return [(lo, min(lo + self.chunk, numel)) for lo in range(0, numel, self.chunk)]

    def _slots(self, numel: int) -> int:
        """Windows per file: SLOTS, or one per chunk when there are fewer."""
        return min(SLOTS, len(self.chunks(numel)))

    def window_bytes(self, numel: int) -> int:
        """RAM the step holds for these files: the windows, each whole pages
        (_allocate_windows)."""
        return self._slots(numel) * window_elements(min(self.chunk, numel)) * 4 * len(self.maps)

    # ---- the step ([Note: offloaded step]) --------------------------------

    def paged_update(self, numel: int, update):
        """Run update(lo, hi, windows) over the chunks of elements
        [0, numel), windows mapping each file's name to its elements
        [lo, hi) in RAM; what update leaves in them is written back."""
        if self.fds is None:
            raise RuntimeError("offload_optimizer: this engine was closed; its offload "
                               "files are gone")
        if os.getpid() != self.pid:
            # the files are shared with the parent, not copied as memory is
            raise RuntimeError("offload_optimizer: a forked child cannot step the parent's "
                               "offloaded states; build an engine in the child")
        self._io.begin()
        self._step_fds = self.io_fds if _aio.direct() else self.fds
        ranges = self.chunks(numel)
        if not ranges:
            return
        slots = self._slots(numel)
        windows = self._allocate_windows(slots, min(self.chunk, numel))
        reads = {}   # chunk index -> request ids
        writes = {}  # window slot -> (chunk, request ids)
        try:
            reads[0] = self._submit(False, windows[0], ranges[0])
            for i, (lo, hi) in enumerate(ranges):
                slot = i % slots
                if i + 1 < len(ranges):
                    following = (i + 1) % slots
                    if following in writes:  # its window is free once written
                        written, requests = writes.pop(following)
                        self._io.finish(requests)
                        if self.write_through:  # most of its writeback is done by now
                            self._uncache_all(*written)
                    reads[i + 1] = self._submit(False, windows[following], ranges[i + 1])
                self._io.finish(reads.pop(i))
                update(lo, hi, {name: t[:hi - lo] for name, t in windows[slot].items()})
                writes[slot] = ((lo, hi), self._submit(True, windows[slot], (lo, hi)))
            for _chunk, requests in writes.values():
                self._io.finish(requests)
        except BaseException:
            # the windows stay held by the engine until their transfers end;
            # a second interrupt may cut this wait short, so the next step
            # gets fresh windows (and waits for what is left first)
            self._windows = None
            self._io.drain()
            raise
        if self.write_through:
            # the step ends with every state on the disk and out of the
            # cache: wait for the writeback the chunks started, then drop
            for fd in self.fds.values():
                os.fdatasync(fd)
            self._uncache_all(0, numel)

    def _allocate_windows(self, slots, elements):
        """SLOTS dicts name -> fp32 window of `elements` (rounded up to whole
        pages), each in an anonymous mapping: page-aligned, as O_DIRECT
        needs ([Note: direct I/O])."""
        name = next(iter(self.maps))
        pages = window_elements(elements)
        if self._windows is None or len(self._windows) != slots or \
                self._windows[0][name].numel() != pages:
            self._windows = [{name: torch.frombuffer(mmap.mmap(-1, pages * 4),
                                                     dtype=torch.float32, count=pages)
                              for name in self.maps} for _ in range(slots)]
        return self._windows

    def close(self):
        """Free the windows and the descriptors (Engine.close), once the
        transfers in flight are over. The files' space returns when the
        mapped tensors are freed with the engine."""
        self._io.drain()
        self._windows = None
        for name, fd in (self.fds or {}).items():
            os.close(fd)
            if self.io_fds.get(name, fd) != fd:
                os.close(self.io_fds[name])
        self.fds = None
        self.io_fds = {}

    def _submit(self, writing, window, chunk):
        """Start reading (or writing) elements chunk=(lo, hi) of every file
        into (or from) its window, rounded up to whole pages; returns the
        request ids."""
        lo, hi = chunk
        n = -(-(hi - lo) // PAGE_ELEMENTS) * PAGE_ELEMENTS
        return [self._io.submit(writing, name, self._step_fds[name], window[name][:n], lo * 4)
                for name in self.maps]

    # ---- residency of the mapping and the page cache -----------------------

    def _pages(self, name, lo, hi):
        """(byte offset, length) of the whole pages that hold elements
        [lo, hi) of file `name`. Widening to whole pages is harmless: a
        dropped page of a shared file mapping keeps its data in the file.
        The end too: the file has whole pages, and fadvise keeps a partial
        last page that is not the file's end."""
        size = self.itemsize[name]
        start = lo * size // mmap.PAGESIZE * mmap.PAGESIZE
        return start, whole_pages(min(hi * size, len(self.maps[name]))) - start

    def _advise(self, name, advice, lo, hi):
        start, length = self._pages(name, lo, hi)
        if length > 0:
            self.maps[name].madvise(advice, start, length)

    def drop(self, name: str | None = None, lo: int = 0, hi: int | None = None):
        """Unmap elements [lo, hi) (default: all) of one file or all from
        the process; with write_through, out of the page cache too."""
        for n in ([name] if name is not None else list(self.maps)):
            end = len(self.maps[n]) // self.itemsize[n] if hi is None else hi
            self._advise(n, mmap.MADV_DONTNEED, lo, end)
            if self.write_through:
                self._uncache(n, lo, end)

    def _uncache(self, name, lo, hi):
        if self.fds is None:  # closed
            return
        start, length = self._pages(name, lo, hi)
        if length > 0:
            os.posix_fadvise(self.fds[name], start, length, os.POSIX_FADV_DONTNEED)

    def _uncache_all(self, lo, hi):
        for name in self.maps:
            self._uncache(name, lo, hi)


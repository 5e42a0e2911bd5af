"""Optimizer states kept in files on a fast disk (offload_optimizer
device "nvme"): each offloaded tensor (the fp32 master, when it is not the
parameters themselves, and every optimizer state) is a file mapped into
memory, so the rest of the engine (the C core's Buffers, checkpoints,
full_state_dict) sees an ordinary CPU tensor.

[Note: offloaded residency] What stays in RAM is managed, not left to the
kernel: the step walks the partition in chunks (HostStep), asks the
kernel to start reading the next chunk while it updates this one
(MADV_WILLNEED: readahead, asynchronous), and drops each chunk from the
process once updated (MADV_DONTNEED on a shared file mapping: the data
stays in the file and the page cache, the process stops holding it). At
rest no offloaded page is held; during the step about two chunks per
tensor are. Dirty pages go to the disk by the kernel's writeback, in the
background; under memory pressure clean pages are evicted and read back
from the file on the next step. The files are unlinked as soon as they
are mapped: they vanish with the process, even after a crash, and their
space returns when the engine is garbage collected.

[Note: write-through] By default a dropped chunk stays in the page cache
(reclaimable memory the process does not hold), so with RAM to spare the
next step reads it from memory. write_through=True also starts each
dropped chunk's writeback and evicts it from the page cache
(POSIX_FADV_DONTNEED: on Linux it starts writeback of the dirty pages and
drops the clean ones), so the states take neither process nor cache
memory and every step reads and writes them on the disk, overlapped with
the update: the behaviour of DeepSpeed's NVMe offload.
"""
from __future__ import annotations

import mmap
import os

import torch

PAGE_ELEMENTS = mmap.PAGESIZE // 4  # fp32 elements per page


class NvmeFiles:
    """The mapped files of one flat group on one rank."""

    def __init__(self, directory: str, label: str, chunk_elements: int,
                 write_through: bool = False):
        self.directory = directory
        self.label = label
        # chunks start on page boundaries, so a chunk is dropped whole
        self.chunk = max(PAGE_ELEMENTS, chunk_elements // PAGE_ELEMENTS * PAGE_ELEMENTS)
        self.write_through = write_through
        self.maps: dict[str, mmap.mmap] = {}
        self.fds: dict[str, int] = {}  # kept for fadvise; closed with this object
        self.nbytes = 0

    def __del__(self):
        for fd in getattr(self, "fds", {}).values():
            os.close(fd)

    def create(self, name: str, numel: int, fill: float = 0.0) -> torch.Tensor:
        """A file-backed fp32 tensor of numel elements, all `fill`."""
        nbytes = numel * 4
        path = os.path.join(self.directory, f"zero-{os.getpid()}-{self.label}-{name}.states")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.unlink(path)
            try:  # the blocks now, so a full disk fails here and not mid-step
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            except OSError as e:
                raise OSError(e.errno, f"offload_optimizer.nvme_path {self.directory!r} has "
                                       f"no room for {nbytes:,} bytes of '{name}': "
                                       f"{e.strerror}") from None
            mapped = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        tensor = torch.frombuffer(mapped, dtype=torch.float32, count=numel)
        self.maps[name] = mapped
        self.fds[name] = fd
        self.nbytes += nbytes
        if fill != 0.0:  # fallocate gave zeros
            for lo, hi in self.chunks(numel):
                tensor[lo:hi].fill_(fill)
                self.drop(name, lo, hi)
        return tensor

    def write(self, name: str, tensor: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Copy `source` into the file-backed `tensor` (of file `name`) a
        chunk at a time, holding at most one chunk of it in RAM."""
        for lo, hi in self.chunks(source.numel()):
            tensor[lo:hi].copy_(source[lo:hi])
            self.drop(name, lo, hi)
        return tensor

    def _advise(self, name, advice, lo, hi):
        mapped = self.maps[name]
        # madvise takes whole pages; widening to them is harmless, as a
        # dropped page of a shared file mapping keeps its data in the file
        start = lo // PAGE_ELEMENTS * mmap.PAGESIZE
        length = min(hi * 4, len(mapped)) - start
        if length > 0:
            mapped.madvise(advice, start, length)

    def prefetch(self, lo: int, hi: int):
        """Start reading elements [lo, hi) of every file (returns at once)."""
        for name in self.maps:
            self._advise(name, mmap.MADV_WILLNEED, lo, hi)

    def drop(self, name: str | None = None, lo: int = 0, hi: int | None = None):
        """Stop holding elements [lo, hi) (default: all) of one file or all
        in RAM; with write_through, start writing them and take them out of
        the page cache too ([Note: write-through])."""
        for n in ([name] if name is not None else list(self.maps)):
            end = len(self.maps[n]) // 4 if hi is None else hi
            self._advise(n, mmap.MADV_DONTNEED, lo, end)
            if self.write_through:
                self._uncache(n, lo, end)

    def _uncache(self, name, lo, hi):
        start = lo // PAGE_ELEMENTS * mmap.PAGESIZE
        length = min(hi * 4, len(self.maps[name])) - start
        if length > 0:
            os.posix_fadvise(self.fds[name], start, length, os.POSIX_FADV_DONTNEED)

    def evict(self):
        """Write every file to the disk and empty the page cache of it, so
        the next step starts cold (bench/offload.py)."""
        for name, mapped in self.maps.items():
            mapped.flush()
            self._advise(name, mmap.MADV_DONTNEED, 0, len(mapped) // 4)
            self._uncache(name, 0, len(mapped) // 4)

    def paged(self, numel: int):
        """Yield the chunks of elements [0, numel) for the caller to update
        in every file, each read ahead before its turn and dropped after
        it. With write_through, a chunk's pages still being written when it
        was dropped stay cached; they are dropped again one chunk later and
        at the end, by when most have reached the disk."""
        ranges = self.chunks(numel)
        if ranges:
            self.prefetch(*ranges[0])
        for i, (lo, hi) in enumerate(ranges):
            if i + 1 < len(ranges):
                self.prefetch(*ranges[i + 1])
            yield lo, hi
            self.drop(None, lo, hi)
            if self.write_through and i > 0:
                for name in self.maps:
                    self._uncache(name, *ranges[i - 1])
        if self.write_through:
            self.drop()

    def chunks(self, numel: int):
        return [(lo, min(lo + self.chunk, numel)) for lo in range(0, numel, self.chunk)]

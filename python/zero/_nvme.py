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
are mapped: they vanish with the process, even after a crash.
"""
from __future__ import annotations

import mmap
import os

import torch

PAGE_ELEMENTS = mmap.PAGESIZE // 4  # fp32 elements per page


class NvmeFiles:
    """The mapped files of one flat group on one rank."""

    def __init__(self, directory: str, label: str, chunk_elements: int):
        self.directory = directory
        self.label = label
        # chunks start on page boundaries, so a chunk is dropped whole
        self.chunk = max(PAGE_ELEMENTS, chunk_elements // PAGE_ELEMENTS * PAGE_ELEMENTS)
        self.maps: dict[str, mmap.mmap] = {}
        self.nbytes = 0

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
        finally:
            os.close(fd)  # the mapping keeps the file
        tensor = torch.frombuffer(mapped, dtype=torch.float32, count=numel)
        self.maps[name] = mapped
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
        in RAM."""
        for n in ([name] if name is not None else list(self.maps)):
            end = len(self.maps[n]) // 4 if hi is None else hi
            self._advise(n, mmap.MADV_DONTNEED, lo, end)

    def chunks(self, numel: int):
        return [(lo, min(lo + self.chunk, numel)) for lo in range(0, numel, self.chunk)]

"""Room on the offload disks, agreed by every rank before any file is made.

[Note: disk room] offload_optimizer and offload_param "nvme" reserve their
files' blocks as they make them (posix_fallocate), so a full disk fails at
initialize rather than mid-step. But the files are made while the engine
is built, between collectives: a rank whose disk was full raised alone,
and the others waited in the next collective until the process group's
timeout. So before the engine is built, each rank works out the bytes its
files will take (estimate_memory's `offloaded` and `params_offloaded`,
from the same layout), reads the free space of its nvme_path(s), and the
ranks share those figures in one gather. Ranks on one machine whose paths
lie on one filesystem share its room, so their needs are summed. If any
disk lacks room, every rank raises (OSError, ENOSPC), each naming the
disk, its free bytes and the ranks that need them. What another process
writes to the disk after the check can still make a file fail on one rank.
"""
from __future__ import annotations

import errno
import os
import socket
import zlib

from zero.engine._estimate import summary_for

# each file is rounded up to whole pages, and a filesystem keeps some
# blocks of its own for a file's extents: a margin for each of a rank's
# offload blocks (optimizer, parameters)
SLACK = 1 << 20


def free_bytes(path: str) -> int:
    """The bytes an unprivileged writer may still take on path's filesystem."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def machine_id() -> int:
    """One number per machine (its boot id; containers on one kernel share
    its disks' device numbers), else per host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            name = f.read().strip()
    except OSError:
        name = socket.gethostname()
    return zlib.crc32(name.encode())


def _needs(model, optimizer, cfg, partitions, device) -> list:
    """[(offload block, path, bytes its files take)] of this rank."""
    blocks = []
    try:
        summary = summary_for(model, optimizer, cfg, partitions, device, frozen_only=True)
    except Exception:  # noqa: BLE001 - a model the estimate cannot lay out:
        return []      # initialize refuses it itself, or the files are made unchecked
    if cfg.offload_optimizer.device == "nvme":
        blocks.append(("offload_optimizer", cfg.offload_optimizer.nvme_path,
                       summary["offloaded"]))
    if cfg.offload_param.device == "nvme":
        blocks.append(("offload_param", cfg.offload_param.nvme_path,
                       summary["params_offloaded"]))
    return blocks


def check_disk_room(model, optimizer, cfg, comm, partitions: int, device):
    """Raise OSError(ENOSPC) on every rank of comm (the engine's whole
    mesh) when the offload files of the ranks that share a disk would not
    fit on it ([Note: disk room]). partitions: the ranks a partition spans
    (the estimate's world size). A collective on every rank, with or
    without files: it runs before the ranks' settings are compared, so a
    rank offloading to files beside one that does not must still meet it
    (a gather on one side only met the settings' agreement and gloo
    aborted); a rank without files sends zeros."""
    if cfg.offload_optimizer.device != "nvme" and cfg.offload_param.device != "nvme":
        blocks = []
        if comm.world == 1:
            return
    else:
        blocks = _needs(model, optimizer, cfg, partitions, device)
    rows = []  # two per rank: (machine, device number, bytes needed, bytes free)
    for _block, path, need in blocks:
        rows += [machine_id(), os.stat(path).st_dev, need + SLACK, free_bytes(path)]
    rows += [0, 0, 0, 0] * (2 - len(blocks))
    every = comm.gather_ints(rows) if comm.world > 1 else [rows]
    disks = {}  # (machine, device) -> [bytes needed, bytes free, ranks]
    for rank, row in enumerate(every):
        for machine, dev, need, free in zip(*[iter(row)] * 4):
            if need == 0:
                continue
            disk = disks.setdefault((machine, dev), [0, free, []])
            disk[0] += need
            disk[1] = min(disk[1], free)
            if rank not in disk[2]:
                disk[2].append(rank)
    short = {key: disk for key, disk in disks.items() if disk[0] > disk[1]}
    if not short:
        return
    mine = [(block, path, need) for block, path, need in blocks
            if (machine_id(), os.stat(path).st_dev) in short]
    if mine:
        block, path, _ = mine[0]
        needed, free, ranks = short[(machine_id(), os.stat(path).st_dev)]
        mine_there = sum(n + SLACK for _b, _p, n in mine)
        raise OSError(errno.ENOSPC, f"zero.initialize: {block}.nvme_path {path!r} has "
                                    f"{size_text(free)} free, but the offload files of rank(s) "
                                    f"{ranks} on that disk need {size_text(needed)} (this rank's: "
                                    f"{size_text(mine_there)}); free space there, use more "
                                    "ranks, or offload less")
    ranks = sorted({r for _need, _free, rs in short.values() for r in rs})
    raise OSError(errno.ENOSPC, f"zero.initialize: the offload disk(s) of rank(s) {ranks} "
                                "lack room for their files (their errors say how much), so "
                                "no rank goes on")


def size_text(nbytes: int) -> str:
    unit, scale = ("GiB", 2**30) if nbytes >= 2**30 else ("MiB", 2**20)
    return f"{nbytes / scale:.2f} {unit} ({nbytes:,} bytes)"

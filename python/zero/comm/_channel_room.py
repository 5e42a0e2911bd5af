"""Room for the reduction channels, agreed by every rank before they are made.

[Note: channel room] Stages 2-3 reduce each param group on a process group
of its own ([Note: reduction channels] in _comm.py), but the small groups
on gloo, which share one ([Note: small groups' buckets] in
sharding/_buckets.py). On gloo each costs
every rank a connection to each other rank and a few descriptors of its
own (measured: 5 a channel on 2 ranks, 6 on 3), kept for the process. A
layer-wise learning-rate recipe (a group per layer and kind: 160 groups
and more) went past 1,024 descriptors on 2 ranks at 250 groups, and gloo
aborted the job from accept() ("Too many open files") on the rank that ran
out first. So before the channels are made, each rank works out the
descriptors they will take, raises its soft limit (RLIMIT_NOFILE) toward
the hard one where that is short, and the ranks share what each could
not: if any rank is short, every rank raises, naming the ranks, the
descriptors and the limit.
"""
from __future__ import annotations

import os
import resource

from zero.comm._comm import channels_made

# a channel's descriptors beyond one a peer (measured 5 on 2 ranks, 6 on 3)
CHANNEL_OWN = 4
# left for the rest of the program (files, sockets, a DataLoader's pipes)
HEADROOM = 256


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _room_for(need: int) -> int:
    """The soft limit on open descriptors, raised toward need where the
    hard limit allows; 0 when unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 0
    if need > soft:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def check_channel_room(comm, groups: int, stage: int, channels: int):
    """Raise RuntimeError on every rank of comm when `channels` reduction
    channels (for `groups` param groups) would take more descriptors than
    some rank may open ([Note: channel room]). A collective on every rank
    of comm."""
    if comm.world == 1:
        return
    ranks = None if comm.group is None else tuple(comm.global_ranks)
    missing = max(0, channels - channels_made(ranks))
    need = _open_descriptors() + missing * (comm.world - 1 + CHANNEL_OWN) + HEADROOM
    limit = _room_for(need) if missing else 0
    rows = comm.gather_ints([need if limit and need > limit else 0, limit])
    short = [(r, n, lim) for r, (n, lim) in enumerate(rows) if n]
    if not short:
        return
    worst = max(n for _r, n, _lim in short)
    raise RuntimeError(
        f"zero: {groups} param groups at stage {stage} reduce their gradients on "
        f"{channels} process groups of their own (about {comm.world - 1 + CHANNEL_OWN} file "
        f"descriptors each on {comm.world} ranks), and rank(s) "
        f"{[r for r, _n, _lim in short]} may open at most "
        f"{min(lim for _r, _n, lim in short)} (raised as far as they allow): {worst} are "
        "needed. "
        "Merge the param groups that share their settings (one group a learning rate and "
        f"weight decay), or raise the limit (ulimit -n {worst}) before the launch")

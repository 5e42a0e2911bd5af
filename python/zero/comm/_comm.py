"""The engine's only door to torch.distributed: joining or creating the
process group, and the collectives it uses, each logged for comm_summary().

On gloo, ReduceOp.AVG is never passed (DESIGN.md): every reduction is a
SUM, and the engine divides by the world size inside the optimizer pass.
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from zero._warnings import warn_user
from zero.comm._handles import AllOf, Watched
from zero.comm._host_staging import ranks_share_a_gpu, run_staged, warn_host_staged
from zero.comm._launcher_env import check_not_half_launched
from zero.comm._launcher_env import launched as launcher_set
from zero.comm._log import CommLog
from zero.comm._world import deepspeed_group_timeout_source

# [Note: timeouts] How long a collective on a group zero makes waits for the
# other ranks before it fails: torch's NCCL default, a third of its gloo one
# (the reasons in docs/engine.md, "Timeouts"). Every group zero makes has the
# same one at any time: the `timeout` setting of the last engine that joined,
# else this default, else, beside a default group the user made, that
# group's own (so the channels wait as long as the user's group does).
# zero.partitioned_init joins without a setting and changes none. A
# collective that times out raises an error that names the timeout and where
# it is set (raise_if_timed_out), at the call or at the handle's wait().
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_UNCHANGED = object()  # join_process_group's timeout for partitioned_init
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (now
# deprecated, with a warning on every call) to all_gather_single and
# reduce_scatter_single; older releases have only the former.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_by_broadcasts(output, shard, rank, world, group=None, async_op=False,
                         sources=None):
    """All-gather `shard` (this rank's) into `output` (world shards back to
    back) on gloo. [Note: gathers on gloo] gloo's all-gather, both
    all_gather_into_tensor and all_gather into a list of views, receives
    into a temporary as large as the output and copies it over: a gather of
    S bytes held 2S at its peak and ran at a quarter of the speed of one
    broadcast per rank straight into the output's slices (2 ranks, 51 MB:
    99 ms and 49 MB extra against 26 ms and none; bench numbers in
    docs/performance.md). So on the CPU each rank's slice is broadcast from
    that rank, in rank order on every rank. NCCL gathers in place and keeps
    its own all-gather. `sources`: the global rank of each of the group's
    ranks (default: the same numbers). Returns a handle whose wait() waits
    for all of them (async_op), else None."""
    slices = output.view(world, -1)
    mine = slices[rank]
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard.reshape(-1))
    sources = sources or range(world)
    works = [dist.broadcast(slices[r], src=sources[r], group=group, async_op=async_op)
             for r in range(world)]
    return AllOf(works) if async_op else None


# The in-memory group this module made (`group`: the default group object
# then) and how many holders share it (engines, and partitioned_init once
# for the life of the process: `held_for_process`). A group destroyed and
# made again by the user is not `group`: it is never counted nor destroyed
# here (a bare counter outlived the group it counted, and a later close()
# destroyed the user's own group).
_owned = {"count": 0, "group": None, "held_for_process": None}
# sys.excepthook before zero's group: torch's init wraps it ("[rank0]: " per
# line), destroy leaves it: each engine of a notebook added one more prefix
_excepthook, _TORCH_HOOK = {"before": None}, "_distributed_excepthook"
# see Comm.channel: the default group they were made beside, and per set of
# global ranks (None: all of them) the channels made for it
_channels = {"world": None, "groups": {}}
# The default group zero made last (from env:// or in memory; it is zero's
# while it is dist.group.WORLD), and the timeout every group zero made has
# now, with where it came from ("setting", "default", "your group"): see
# [Note: timeouts].
_made = {"world": None}
_timeout = {"value": None, "source": None}
_exit_hook = {"registered": False}


def nccl_available() -> bool:
    return dist.is_nccl_available()


def world_size() -> int:
    """The default group's size; 1 where no group was made."""
    return dist.get_world_size() if dist.is_initialized() else 1


def backend_for(device: torch.device, world: int) -> str:
    """The process-group backend for a model on `device`: gloo on the CPU;
    NCCL for CUDA tensors, with gloo beside it for the few CPU tensors
    (checks, scalars) a caller may pass. A world of one rank never sends a
    model tensor (Comm skips every collective), so it takes gloo even on a
    GPU: no NCCL communicator to set up in a notebook. Ranks that share a
    GPU take gloo too: NCCL refuses two ranks on one device, and their
    collectives are staged through host memory ([Note: host-staged
    collectives])."""
    if device.type == "cpu" or world == 1 or ranks_share_a_gpu():
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def stages_through_host(device: torch.device, group=None) -> bool:
    """Whether a Comm over `group` stages its collectives through host
    memory: a model on a GPU, and a group without NCCL for its tensors."""
    return device.type != "cpu" and dist.get_world_size(group) > 1 and \
        "nccl" not in group_backend(group)


def group_backend(group=None) -> str:
    """A group's backends (None: the default group's): "gloo", "nccl", or
    per device type ("cpu:gloo,cuda:nccl"; torch writes plain "gloo" as
    "cpu:gloo,cuda:gloo")."""
    describe = getattr(dist, "get_backend_config", dist.get_backend)
    return str(describe(group)).lower()


def check_backend(device: torch.device):
    """An existing default group must be able to reduce tensors on `device`."""
    backend = group_backend()
    needs = "gloo" if device.type == "cpu" else "nccl"
    if needs in backend or (device.type == "cpu" and "mpi" in backend) or \
            (device.type != "cpu" and dist.get_world_size() == 1):  # see backend_for
        return
    if device.type != "cpu" and "gloo" in backend and \
            (ranks_share_a_gpu() or not _holds_current_group()):
        warn_host_staged(backend)  # staged through host memory: correct, slower
        return
    if _holds_current_group():
        raise RuntimeError(
            f"an open zero engine (or zero.partitioned_init) made this process's group for "
            f"{'CPU' if needs == 'nccl' else 'CUDA'} tensors, with backend {backend!r}; "
            f"{device.type} tensors need {needs}: close() that engine first")
    raise RuntimeError(
        f"the process group was made with backend {backend!r}, which cannot reduce the "
        f"model's {device.type} tensors ({needs} can); make it with backend "
        f"{backend_for(device, dist.get_world_size())!r}, or let zero.initialize make it")


def join_process_group(device: torch.device, backend: str | None = None,
                       timeout: float | None = None) -> bool:
    """Make sure a default process group exists that can reduce tensors on
    `device`; True if the caller owns it and should destroy it when done.
    `backend` overrides backend_for() for a group made here; `timeout`
    (seconds, None: not set; _UNCHANGED: leave the groups' as they are) is
    applied to every group zero made ([Note: timeouts]), never to one the
    user made.

    An existing group is reused. Under torchrun (RANK etc. set) the group is
    made from env:// and kept for the life of the process (destroyed at
    exit): a second rendezvous on the same port in one process can meet the
    first one's store still listening and wait forever, so a later engine
    reuses the group instead. With no launcher at all (a notebook, a plain
    script) a one-process group is made in memory and owned by the engine.
    """
    if dist.is_initialized():
        check_backend(device)
        if timeout is not _UNCHANGED:
            _settle_timeout(timeout)
        _at_exit_once()  # [Note: gloo at exit], whoever made the group
        if _holds_current_group():
            # an in-memory group another engine made: share it, so that
            # engine's close() does not destroy it under this one
            _owned["count"] += 1
            return True
        _forget_group()  # env:// (kept for the process) or the user's
        return False
    launched = launcher_set()
    backend = backend or backend_for(device, int(os.environ["WORLD_SIZE"]) if launched else 1)
    # bound to the model's device, so NCCL never guesses from the current one
    bind = {"device_id": device} if "nccl" in backend and device.type == "cuda" else {}
    if device.type != "cpu" and "nccl" not in backend and launched and \
            int(os.environ["WORLD_SIZE"]) > 1:
        warn_host_staged(backend)
    if timeout is _UNCHANGED:
        timeout = None
    wait = DEFAULT_TIMEOUT if timeout is None else datetime.timedelta(seconds=timeout)
    if launched:
        dist.init_process_group(backend, init_method="env://", timeout=wait, **bind)
        _made_here(wait, timeout)
        return False
    else:
        check_not_half_launched()  # [Note: launcher environment]
        _excepthook["before"] = sys.excepthook
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=wait, **bind)
        # partitioned_init's group is never left, and a live gloo group at
        # interpreter exit can end in "terminate called"
        _made_here(wait, timeout)
    _owned.update(count=1, group=dist.group.WORLD, held_for_process=None)
    return True


def _made_here(wait: datetime.timedelta, timeout):
    _made["world"] = dist.group.WORLD
    _timeout.update(value=wait, source="default" if timeout is None else "setting")
    _at_exit_once()


def current_timeout() -> datetime.timedelta:
    """The timeout the groups zero makes are given now ([Note: timeouts])."""
    return _timeout["value"] or DEFAULT_TIMEOUT


def all_channels() -> list:
    """Every reduction channel zero made (Comm.channel), for every group."""
    return [g for groups in _channels["groups"].values() for g in groups]


def channels_made(ranks) -> int:
    """Comm.channel's count for `ranks` (None: the default group's) today."""
    fresh = _channels["world"] is dist.group.WORLD
    return len(_channels["groups"].get(ranks, [])) if fresh else 0


def made_by_zero(group=None) -> bool:
    """Whether `group` (None: the default group) is one zero made."""
    if group is not None and group is not dist.group.WORLD:
        return any(group is g for g in all_channels())
    return dist.is_initialized() and dist.group.WORLD is _made["world"]


def _settle_timeout(timeout):
    """Give every group zero made the timeout an engine joining now asks for
    (seconds, None: not set); see [Note: timeouts]."""
    if timeout is not None:
        wait, source = datetime.timedelta(seconds=timeout), "setting"
    elif made_by_zero():
        wait, source = DEFAULT_TIMEOUT, "default"
    else:
        wait = group_timeout()
        wait, source = (DEFAULT_TIMEOUT, "default") if wait is None else (wait, "your group")
    ours = ([dist.group.WORLD] if made_by_zero() else []) + \
        (all_channels() if _channels["world"] is dist.group.WORLD else [])
    if ours and wait != _timeout["value"]:
        change = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if change is None:  # torch older than 2.3
            warn_user(f"zero: the process groups zero made keep their timeout of "
                      f"{_duration(_timeout['value'])}: torch {torch.__version__} cannot "
                      f"change it to {_duration(wait)}", RuntimeWarning)
            return
        for group in ours:
            change(wait, group)
    _timeout.update(value=wait, source=source)


def group_timeout(group=None):
    """The timeout `group` (None: the default group) was made with, as torch
    keeps it in its backend's options; None where this torch does not say."""
    group = group or dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            wait = group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(wait, datetime.timedelta):
            return wait
    return None


def _duration(wait) -> str:
    if wait is None:
        return "its timeout"
    seconds = wait.total_seconds()
    if seconds >= 120 and seconds % 60 == 0:
        return f"{seconds / 60:g} minutes"
    return f"{seconds:g} s"


def issue(what: str, on, collective, *args, **kwargs):
    """collective(*args, **kwargs), the collective `what` on the group `on`
    (None: the default group), with its timeout named (raise_if_timed_out)
    whether it is raised here or at the returned handle's wait() (when
    kwargs has async_op=True)."""
    try:
        work = collective(*args, **kwargs)
    except RuntimeError as error:
        raise_if_timed_out(error, what, on)
        raise
    return Watched(work, raise_if_timed_out, what, on) if kwargs.get("async_op") else work


def raise_if_timed_out(error: RuntimeError, op: str, group=None):
    """Raise, from `error`, the error that names the timeout and where it is
    set when `error` is a collective's timeout; return otherwise (the
    caller re-raises `error`). gloo raises a RuntimeError "Timed out
    waiting 3000ms for recv operation to complete" at the call, or at the
    wait() of an async one; the other rank of a pair whose wait timed out
    gets "Application timeout caused pair closure"."""
    text = str(error).lower()
    if not ("timed out" in text or "timeout caused pair closure" in text) or \
            text.startswith("zero: "):
        return
    if made_by_zero(group):
        wait = _timeout["value"]
        where = "a process group zero made"
        if _timeout["source"] == "your group":
            how = ("zero's `timeout` setting is not set, so zero's groups take the timeout of "
                   "the default process group your code made; set it with "
                   "zero.initialize(timeout=seconds)")
        else:
            how = (f"it is zero's `timeout` setting ("
                   f"{'set to' if _timeout['source'] == 'setting' else 'left at its default,'} "
                   f"{_duration(wait)}): zero.initialize(timeout=seconds), zero.Config(timeout=), "
                   "or \"comms_timeout\" in a DeepSpeed-style config")
    elif (source := deepspeed_group_timeout_source(group)) is not None:
        wait = group_timeout(group)
        where = "the default process group"
        how = f"{source}; set it there, or call zero.deepspeed.init_distributed(timeout=...) first"
    else:
        wait = group_timeout(group)
        where = "the process group your code made"
        how = ("it is that group's own, set where it is made (dist.init_process_group("
               "timeout=...), or TrainingArguments(ddp_timeout=...) under the HF Trainer); "
               "zero's `timeout` setting applies to the groups zero makes")
    raise RuntimeError(
        f"zero: {op} on {where} timed out: another rank did not join it within "
        f"{_duration(wait)} (the process group's timeout). That rank has stopped, hangs, "
        f"crashed without its process ending, or is busy elsewhere for longer (saving or "
        f"evaluating alone: a collective call made on some ranks only, which a longer "
        f"timeout would only wait longer for); if a rank may legitimately wait that long, "
        f"raise the timeout: {how}. ({type(error).__name__}: {error})") from error


def join_for_the_process(device: torch.device, backend: str | None = None):
    """join_process_group for a holder that never leaves
    (zero.partitioned_init): one reference per group, however often it
    runs (a notebook cell run again)."""
    if join_process_group(device, backend, _UNCHANGED):
        if _owned["held_for_process"] is _owned["group"]:
            _owned["count"] -= 1  # held already
        else:
            _owned["held_for_process"] = _owned["group"]


def _holds_current_group() -> bool:
    return _owned["count"] > 0 and dist.is_initialized() and \
        dist.group.WORLD is _owned["group"]


def _forget_group():
    _owned.update(count=0, group=None, held_for_process=None)


def _at_exit_once():
    if not _exit_hook["registered"]:  # one, however many groups and engines
        atexit.register(_at_exit)
        _exit_hook["registered"] = True


def _at_exit():
    """[Note: gloo at exit] A gloo worker thread drops its reference to a
    collective's tensors just after the rank waiting on it is told the work
    is done. When Python let go of such a tensor first (a view made for one
    broadcast, a temporary of a few numbers), that last drop takes the GIL;
    if the interpreter is finalizing by then, the thread is ended inside a
    C++ destructor and the process aborts ("terminate called without an
    active exception", exit -6) after a run that finished well (1 in 5
    two-rank nvme-offload runs on zero's own group before this hook).
    Sleeping releases the GIL to such a thread before finalization starts
    (the core dump of one abort: a gloo worker in ~AsyncBroadcastWork ->
    decref_pyobject -> take_gil -> pthread_exit while the main thread was
    in Py_FinalizeEx). This runs
    whatever made the default group: runs on a group the user made (a
    script's dist.init_process_group, accelerate under the HF Trainer)
    aborted in 6 of 20 two-rank stage-2 runs without it (the last
    collective, stage 2's gather of the updated parameters, broadcasts
    views; stage 0, which reduces a long-lived buffer only, never did).
    Then zero destroys what it made, and only that: every group when it
    made the default one, else its channels beside the user's group, which
    is left as it is for the user's own exit code."""
    time.sleep(0.05)
    channels = all_channels() if _channels["world"] is dist.group.WORLD else []
    _channels.update(world=None, groups={})
    if not dist.is_initialized():
        return
    if made_by_zero():
        dist.destroy_process_group()  # every group, the channels too
        return
    for group in channels:
        dist.destroy_process_group(group)


def leave_process_group(created: bool):
    if not created:
        return
    if not _holds_current_group():
        _forget_group()  # ours was destroyed by the user: theirs is not ours to end
        return
    _owned["count"] -= 1
    if _owned["count"] == 0:
        _forget_group()
        dist.destroy_process_group()
        before, _excepthook["before"] = _excepthook["before"], None
        if before is not None and getattr(sys.excepthook, "__name__", "") == _TORCH_HOOK:
            sys.excepthook = before  # torch's wrapper only: a hook set since is kept


class Comm:
    """Collectives over one process group, logged: the default group, or
    the one given to zero.initialize as `mesh` (a group or a 1-D
    DeviceMesh's), whose ranks `rank` and `world` then count. Every rank
    number passed in or out (src, dst, owner) is the group's; the global
    rank each stands for is in `global_ranks`. `device` is the model's.
    Small host-side numbers (flags, checks) travel as CPU tensors when the
    group has gloo for them, so the host never waits for the GPU to read
    them back; a group made with NCCL alone gets them on the device."""

    def __init__(self, device: torch.device = torch.device("cpu"), group=None):
        self.device = device
        host_ok = device.type == "cpu" or "gloo" in group_backend(group)
        self.scalar_device = torch.device("cpu") if host_ok else device
        self.group = group  # None: the default group
        # [Note: host-staged collectives] in _host_staging.py
        self.staged = stages_through_host(device, group)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.global_ranks = list(range(self.world)) if group is None else \
            dist.get_process_group_ranks(group)
        self.log = CommLog()
        # hybrid sharding (with_replicas): the Comm over this rank's
        # replicas, and the one over every data-parallel rank, which the
        # agreements and rank 0's broadcasts span
        self.replicate = None
        self.everyone = self
        # tensor and pipeline parallelism (with_model_parallel): the Comm
        # over every rank of the engine, data and model parallel
        self._whole = None

    def with_replicas(self, replicate_group, everyone_group) -> "Comm":
        """This Comm partitioning over its group, with replicas of its
        partitions across `replicate_group` ([Note: hybrid sharding])."""
        self.replicate = Comm(self.device, replicate_group)
        self.everyone = Comm(self.device, everyone_group)
        # each replica must hold the same partition: a rank's replicas have
        # its rank in their rows (a hand-built mesh may pair them otherwise,
        # and partitions of other ranks would be summed)
        # and agreed over every rank, so all refuse together
        partitions = self.replicate.gather_scalars(self.rank)
        crossed = self.everyone.sum_scalar(float(len(set(partitions)) > 1))
        if crossed:
            raise ValueError(f"mesh: replicas must hold the same partition (the same place in "
                             f"each dp_shard row, as init_device_mesh lays them out); the "
                             f"dp_replicate group of global rank {self.global_rank} joins "
                             f"places {partitions} of their rows, and {crossed:.0f} rank(s) "
                             "found such a group")
        return self

    def with_model_parallel(self, whole_group) -> "Comm":
        """This Comm, in an engine whose ranks also split the model (tp,
        pp): `whole_group` holds every rank of it, which a checkpoint's
        agreements and its one meta writer span."""
        self._whole = Comm(self.device, whole_group)
        return self

    @property
    def whole(self) -> "Comm":
        """Every rank of the engine: the data-parallel ones, times the
        model-parallel ones of a tensor- or pipeline-parallel model."""
        return self._whole if self._whole is not None else self.everyone

    @property
    def dp_world(self) -> int:
        """Every data-parallel rank: the partitions' group times its replicas."""
        return self.everyone.world

    def channel(self, index: int) -> "Comm":
        """Reduction channel `index`: a Comm over a process group of its own
        (the same ranks and backend), logging into this one's log.
        [Note: reduction channels] A backend pairs the ranks' collectives
        on one group by their order. Where that order depends on each
        rank's data (which gradients its backward produced, and when), the
        collectives go on a channel of their own, so only their order
        among themselves must match. Channels are made on first use (a
        collective: engines ask for them in the same order on every rank)
        and kept for the process, shared by later engines, so an engine
        dropped without close() leaks no process group; a new default group
        starts a new set (destroying the default group destroys them).
        Two engines whose backwards run at once share channel 0: their
        buckets must then come in the same order on every rank."""
        if self.world == 1:
            return self
        if _channels["world"] is not dist.group.WORLD:
            _channels.update(world=dist.group.WORLD, groups={})
        ranks = None if self.group is None else tuple(self.global_ranks)
        groups = _channels["groups"].setdefault(ranks, [])
        wait = _timeout["value"] or DEFAULT_TIMEOUT
        while len(groups) <= index:
            if ranks is None:
                groups.append(dist.new_group(timeout=wait))
            else:  # made by the group's ranks alone: the others train apart
                groups.append(dist.new_group(list(ranks), timeout=wait,
                                             use_local_synchronization=True))
        channel = Comm.__new__(Comm)
        channel.__dict__.update(self.__dict__)
        channel.group = groups[index]
        return channel

    def all_reduce_sum(self, tensor, async_op=False):
        self.log.record("all_reduce", tensor)
        if self.world == 1:
            return None
        return self._issue("all_reduce", dist.all_reduce, tensor, op=dist.ReduceOp.SUM,
                           group=self.group, async_op=async_op, reads=(0,), writes=(0,))

    def reduce_sum(self, tensor, dst: int, async_op=False):
        self.log.record("reduce", tensor)
        if self.world == 1:
            return None
        return self._issue("reduce", dist.reduce, tensor, dst=self.global_ranks[dst],
                           op=dist.ReduceOp.SUM, group=self.group, async_op=async_op,
                           reads=(0,), writes=(0,) if dst == self.rank else ())

    def reduce_scatter_sum(self, output, tensor, async_op=False):
        """output (1/world of tensor) := the sum over ranks of this rank's
        chunk of tensor."""
        self.log.record("reduce_scatter", tensor)
        if self.world == 1:
            output.copy_(tensor)
            return None
        return self._issue("reduce_scatter", reduce_scatter_single, output, tensor,
                           op=dist.ReduceOp.SUM, group=self.group, async_op=async_op,
                           reads=(1,), writes=(0,))

    def all_gather_into(self, output, shard, async_op=False):
        self.log.record("all_gather", output)
        if self.world == 1:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return None
        if output.device.type == "cpu" or self.staged:  # [Note: gathers on gloo]
            return self._issue("all_gather", gather_by_broadcasts, output, shard, self.rank,
                               self.world, self.group, async_op=async_op,
                               sources=self.global_ranks, reads=(1,), writes=(0,))
        return self._issue("all_gather", all_gather_single, output, shard, group=self.group,
                           async_op=async_op)

    def broadcast(self, tensor, src=0):
        if self.world > 1:
            mine = src == self.rank
            self._issue("broadcast", dist.broadcast, tensor, src=self.global_ranks[src],
                        group=self.group, reads=(0,) if mine else (),
                        writes=() if mine else (0,))

    def _issue(self, what, collective, *args, reads=(), writes=(), **kwargs):
        """issue() on this Comm's group; on a host-staged one the tensors at
        positions `reads` and `writes` of args go through host copies
        (run_staged)."""
        if self.staged and (reads or writes):
            return run_staged(self, what, collective, args, reads, writes, **kwargs)
        return issue(what, self.group, collective, *args, **kwargs)

    def gather_scalars(self, value: int) -> list:
        """Every rank's integer, in rank order (not logged: a check, not
        training traffic)."""
        return [row[0] for row in self.gather_ints([value])]

    def gather_ints(self, values: list) -> list:
        """Every rank's list of 64-bit integers (the same length on every
        rank), in rank order; not logged, like gather_scalars."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.scalar_device)
        every = torch.empty(self.world * mine.numel(), dtype=torch.int64,
                            device=self.scalar_device)
        self._issue("all_gather", all_gather_single, every, mine, group=self.group)
        return every.view(self.world, -1).tolist()

    def gather_objects(self, obj) -> list | None:
        """Every rank's picklable object, in rank order, on the group's rank
        0 (None on the others); not logged, like gather_scalars."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        self._issue("gather_object", dist.gather_object, obj, out, dst=self.global_ranks[0],
                    group=self.group)
        return out

    def sum_scalars_(self, tensor):
        """Sum a few numbers (a tensor on the model's device) over ranks in
        place; not logged, like sum_scalar."""
        if self.world > 1:
            self._issue("all_reduce", dist.all_reduce, tensor, op=dist.ReduceOp.SUM,
                        group=self.group, reads=(0,), writes=(0,))

    def sum_scalar(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.scalar_device)
        self.sum_scalars_(t)
        return float(t.item())

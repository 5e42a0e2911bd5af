"""The engine's only door to torch.distributed: joining or creating the
process group, and the collectives it uses, each logged for comm_summary().

On gloo, ReduceOp.AVG is never passed (DESIGN.md): every reduction is a
SUM, and the engine divides by the world size inside the optimizer pass.
"""
from __future__ import annotations

import atexit
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# torch 2.13 renamed all_gather_into_tensor (now deprecated, with a warning
# on every call) to all_gather_single; older releases have only the former.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_by_broadcasts(output, shard, rank, world, group=None, async_op=False):
    """All-gather `shard` (this rank's) into `output` (world shards back to
    back) on gloo. [Note: gathers on gloo] gloo's all-gather, both
    all_gather_into_tensor and all_gather into a list of views, receives
    into a temporary as large as the output and copies it over: a gather of
    S bytes held 2S at its peak and ran at a quarter of the speed of one
    broadcast per rank straight into the output's slices (2 ranks, 51 MB:
    99 ms and 49 MB extra against 26 ms and none; bench numbers in
    docs/performance.md). So on the CPU each rank's slice is broadcast from
    that rank, in rank order on every rank. NCCL gathers in place and keeps
    its own all-gather. Returns a handle whose wait() waits for all of them
    (async_op), else None."""
    slices = output.view(world, -1)
    mine = slices[rank]
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard.reshape(-1))
    works = [dist.broadcast(slices[r], src=r, group=group, async_op=async_op)
             for r in range(world)]
    return _AllOf(works) if async_op else None


class _AllOf:
    """The handle of several collectives: done when all are."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


# The in-memory group this module made (`group`: the default group object
# then) and how many holders share it (engines, and partitioned_init once
# for the life of the process: `held_for_process`). A group destroyed and
# made again by the user is not `group`: it is never counted nor destroyed
# here (a bare counter outlived the group it counted, and a later close()
# destroyed the user's own group).
_owned = {"count": 0, "group": None, "held_for_process": None}
_channels = {"world": None, "groups": []}  # see Comm.channel


def backend_for(device: torch.device, world: int) -> str:
    """The process-group backend for a model on `device`: gloo on the CPU;
    NCCL for CUDA tensors, with gloo beside it for the few CPU tensors
    (checks, scalars) a caller may pass. A world of one rank never sends a
    model tensor (Comm skips every collective), so it takes gloo even on a
    GPU: no NCCL communicator to set up in a notebook."""
    return "gloo" if device.type == "cpu" or world == 1 else "cpu:gloo,cuda:nccl"


def group_backend() -> str:
    """The default group's backends: "gloo", "nccl", or per device type
    ("cpu:gloo,cuda:nccl"; torch writes plain "gloo" as "cpu:gloo,cuda:gloo")."""
    describe = getattr(dist, "get_backend_config", dist.get_backend)
    return str(describe()).lower()


def check_backend(device: torch.device):
    """An existing default group must be able to reduce tensors on `device`."""
    backend = group_backend()
    needs = "gloo" if device.type == "cpu" else "nccl"
    if needs in backend or (device.type == "cpu" and "mpi" in backend) or \
            (device.type != "cpu" and dist.get_world_size() == 1):  # see backend_for
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


def join_process_group(device: torch.device, backend: str | None = None) -> bool:
    """Make sure a default process group exists that can reduce tensors on
    `device`; True if the caller owns it and should destroy it when done.
    `backend` overrides backend_for() for a group made here.

    An existing group is reused. Under torchrun (RANK etc. set) the group is
    made from env:// and kept for the life of the process (destroyed at
    exit): a second rendezvous on the same port in one process can meet the
    first one's store still listening and wait forever, so a later engine
    reuses the group instead. With no launcher at all (a notebook, a plain
    script) a one-process group is made in memory and owned by the engine.
    """
    if dist.is_initialized():
        check_backend(device)
        if _holds_current_group():
            # an in-memory group another engine made: share it, so that
            # engine's close() does not destroy it under this one
            _owned["count"] += 1
            return True
        _forget_group()  # the user's group (ours, if any, was destroyed)
        return False
    launched = all(v in os.environ for v in _LAUNCHER_VARS)
    backend = backend or backend_for(device, int(os.environ["WORLD_SIZE"]) if launched else 1)
    # bound to the model's device, so NCCL never guesses from the current one
    bind = {"device_id": device} if "nccl" in backend and device.type == "cuda" else {}
    if launched:
        dist.init_process_group(backend, init_method="env://", **bind)
        _destroy_at_exit_once()
        return False
    else:
        present = [v for v in _LAUNCHER_VARS if v in os.environ]
        missing = [v for v in _LAUNCHER_VARS if v not in os.environ]
        if present and os.environ.get("WORLD_SIZE", "1") != "1":
            raise RuntimeError(
                f"launcher variables {', '.join(present)} are set but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not; start "
                "with torchrun, set the missing ones, or unset them")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **bind)
        # partitioned_init's group is never left, and a live gloo group at
        # interpreter exit can end in "terminate called"
        _destroy_at_exit_once()
    _owned.update(count=1, group=dist.group.WORLD, held_for_process=None)
    return True


def join_for_the_process(device: torch.device, backend: str | None = None):
    """join_process_group for a holder that never leaves
    (zero.partitioned_init): one reference per group, however often it
    runs (a notebook cell run again)."""
    if join_process_group(device, backend):
        if _owned["held_for_process"] is _owned["group"]:
            _owned["count"] -= 1  # held already
        else:
            _owned["held_for_process"] = _owned["group"]


def _holds_current_group() -> bool:
    return _owned["count"] > 0 and dist.is_initialized() and \
        dist.group.WORLD is _owned["group"]


def _forget_group():
    _owned.update(count=0, group=None, held_for_process=None)


def _destroy_at_exit_once():
    atexit.unregister(_destroy_at_exit)  # one registration, however many groups
    atexit.register(_destroy_at_exit)


def _destroy_at_exit():
    """[Note: gloo at exit] A gloo worker thread drops its reference to an
    async collective's tensors just after the waiting rank is told the
    work is done. When Python let go of such a tensor first, that last
    drop takes the GIL; if the interpreter is finalizing by then, the
    thread is ended inside a C++ destructor and the process aborts
    ("terminate called without an active exception") after a run that
    finished well: 1 in 5 two-rank nvme-offload runs here. Sleeping
    releases the GIL to such a thread before finalization starts."""
    time.sleep(0.05)
    _channels.update(world=None, groups=[])
    if dist.is_initialized():
        dist.destroy_process_group()  # every group, the channels too


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


class CommLog:
    """Elements and bytes per collective since the last reset().

    `moved_elements` counts what each collective carries in the ZeRO paper's
    accounting: a reduce, reduce-scatter, all-gather or broadcast of n
    elements moves n; an all-reduce moves 2n (a reduce-scatter plus an
    all-gather).
    """

    WEIGHT = {"all_reduce": 2}

    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = defaultdict(int)
        self.elements = defaultdict(int)
        self.bytes = defaultdict(int)

    def record(self, op: str, tensor: torch.Tensor, elements: int | None = None):
        n = tensor.numel() if elements is None else elements
        self.calls[op] += 1
        self.elements[op] += n
        self.bytes[op] += n * tensor.element_size()

    def summary(self) -> dict:
        ops = {op: {"calls": self.calls[op], "elements": self.elements[op],
                    "bytes": self.bytes[op]} for op in self.calls}
        moved = sum(self.WEIGHT.get(op, 1) * e for op, e in self.elements.items())
        return {"ops": ops, "moved_elements": moved,
                "moved_bytes": sum(self.WEIGHT.get(op, 1) * b for op, b in self.bytes.items())}


class Comm:
    """Collectives over the default group, logged. `device` is the model's.
    Small host-side numbers (flags, checks) travel as CPU tensors when the
    group has gloo for them, so the host never waits for the GPU to read
    them back; a group made with NCCL alone gets them on the device."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = device
        host_ok = device.type == "cpu" or "gloo" in group_backend()
        self.scalar_device = torch.device("cpu") if host_ok else device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.log = CommLog()
        self.group = None  # the default group

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
            _channels.update(world=dist.group.WORLD, groups=[])
        groups = _channels["groups"]
        while len(groups) <= index:
            groups.append(dist.new_group())
        channel = Comm.__new__(Comm)
        channel.__dict__.update(self.__dict__)
        channel.group = groups[index]
        return channel

    def all_reduce_sum(self, tensor, async_op=False):
        self.log.record("all_reduce", tensor)
        if self.world == 1:
            return None
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group,
                               async_op=async_op)

    def reduce_sum(self, tensor, dst: int, async_op=False):
        self.log.record("reduce", tensor)
        if self.world == 1:
            return None
        return dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=self.group,
                           async_op=async_op)

    def all_gather_into(self, output, shard, async_op=False):
        self.log.record("all_gather", output)
        if self.world == 1:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return None
        if output.device.type == "cpu":  # [Note: gathers on gloo]
            return gather_by_broadcasts(output, shard, self.rank, self.world, self.group,
                                        async_op)
        return all_gather_single(output, shard, group=self.group, async_op=async_op)

    def broadcast(self, tensor, src=0):
        if self.world > 1:
            dist.broadcast(tensor, src=src, group=self.group)

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
        all_gather_single(every, mine, group=self.group)
        return every.view(self.world, -1).tolist()

    def sum_scalars_(self, tensor):
        """Sum a few numbers (a tensor on the model's device) over ranks in
        place; not logged, like sum_scalar."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def sum_scalar(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.scalar_device)
        self.sum_scalars_(t)
        return float(t.item())

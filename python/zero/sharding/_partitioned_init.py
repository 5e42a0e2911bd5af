"""zero.partitioned_init(): build a model too large for one rank.

    with zero.partitioned_init():
        model = GPT(config)          # each rank keeps 1/N of every parameter
    engine = zero.initialize(model, stage=3, ...)

[Note: partitioned construction]
- When a module registers a parameter (torch's global parameter-registration
  hook, a documented hook, not a patch), the parameter's values are cut to
  this rank's chunk and the module gets a placeholder parameter of the right
  shape and dtype whose storage is one element (stride 0).
- A TorchDispatchMode sees every op while the context is open. An op that
  touches a placeholder runs for real on the parameter's full values: they
  are all-gathered from the chunks (or, when the op overwrites the whole
  parameter, such as normal_ or zero_, just allocated), the op runs, and the
  chunk is cut again when another parameter is touched. So the model's own
  init code (module constructors, `self.apply(_init_weights)`, rejection
  sampling in trunc_normal_) runs the same ops in the same order on the same
  random stream as without the engine, and the values are bit-identical,
  while a rank holds its chunks plus one full parameter at a time.
- View ops on a placeholder (w[0], w.data, w.t()) return a placeholder of
  the view's shape that remembers how it was made, and is resolved against
  the full values when an op uses it.
- Every rank must run the same construction code with the same seed (as
  any torchrun job does for identical initial weights); this is checked on
  entry. Gathers are collectives, issued in program order.
- No torch global is replaced. Outside the context, reading a placeholder
  gives zeros and writing it raises; zero.initialize() turns the chunks into
  the engine's partitions one parameter at a time.
"""
from __future__ import annotations

import functools
import hashlib
import os

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from zero._progress import bar
from zero.comm._comm import (Comm, backend_for, gather_by_broadcasts, issue,
                             join_for_the_process, nccl_available)
from zero.config._config import check_nvme_path
from zero.offload._mapped import MappedFile, release_freed_memory
from zero.sharding._before_decomposition import BeforeDecomposition
from zero.sharding._units import storage_key

_CHUNK_ALIGN = 16
# ops that overwrite every element of their target, so the old values need
# not be gathered first
_OVERWRITES = {
    torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default,
    torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar,
    torch.ops.aten.random_.default, getattr(torch.ops.aten.random_, "from"),
    torch.ops.aten.random_.to, torch.ops.aten.bernoulli_.float,
    torch.ops.aten.exponential_.default, torch.ops.aten.log_normal_.default,
    torch.ops.aten.cauchy_.default, torch.ops.aten.geometric_.default,
}

# view ops that alias the whole tensor (w.data, w.detach()): an op that
# overwrites such a view overwrites the whole parameter
_WHOLE_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


def _whole(chain) -> bool:
    return all(op in _WHOLE_ALIASES for op, _args, _kwargs in chain)


# placeholder parameter -> its _Sharded record, for zero.initialize
_registry = WeakIdKeyDictionary()


class _Sharded:
    """One parameter's chunk on this rank, and the cached full values."""

    def __init__(self, full: torch.Tensor, rank: int, world: int, directory=None):
        """directory: keep the chunk in a file there (partitioned_init's
        nvme_path), resident only while it is read or written."""
        self.shape, self.dtype = full.shape, full.dtype
        self.numel = full.numel()
        per = -(-self.numel // world)
        self.part = -(-per // _CHUNK_ALIGN) * _CHUNK_ALIGN
        self.rank, self.world = rank, world
        self._file = None
        if directory is None:
            self.chunk = torch.zeros(self.part, dtype=self.dtype)
        else:
            self._file = MappedFile(directory, self.part, self.dtype,
                                    "partitioned_init nvme_path")
            self.chunk = self._file.tensor
        self.store(full.detach())

    def _done_with_chunk(self):
        if self._file is not None:
            self._file.drop()

    def gather(self) -> torch.Tensor:
        """The full values (a collective)."""
        out = torch.empty(self.part * self.world, dtype=self.dtype)
        if self.world == 1:
            out.copy_(self.chunk)
        else:
            issue("all_gather", None, gather_by_broadcasts, out, self.chunk, self.rank,
                  self.world)
        self._done_with_chunk()
        return out[:self.numel].view(self.shape)

    def store(self, full: torch.Tensor):
        flat = full.reshape(-1)
        lo = min(self.rank * self.part, self.numel)
        hi = min(lo + self.part, self.numel)
        self.chunk[:hi - lo].copy_(flat[lo:hi])
        self._done_with_chunk()


def _placeholder(shape, dtype, requires_grad=None):
    t = torch.zeros((), dtype=dtype).expand(shape)
    return nn.Parameter(t, requires_grad=requires_grad) if requires_grad is not None else t


class _LazyView:
    def __init__(self, base, chain):
        self.base = base      # the placeholder parameter
        self.chain = chain    # [(view op, args after the tensor, kwargs)]


class partitioned_init(TorchDispatchMode):
    """Context manager: parameters created inside live as 1/N chunks."""

    def __init__(self, nvme_path=None):
        """nvme_path: an existing directory (a fast disk) for the chunks,
        so that building takes one parameter's full values of memory and
        no more, whatever the model's size (a model larger than RAM, to be
        trained with offload_param and offload_optimizer "nvme"). Without
        it the chunks are in memory: 1/N of the model per rank."""
        super().__init__()
        if nvme_path is not None:
            check_nvme_path(nvme_path, "partitioned_init nvme_path")
            nvme_path = os.fspath(nvme_path)
        self._directory = nvme_path
        # storage of a placeholder (or of its .data alias) -> (its owner, _LazyView);
        # the owner is held so the storage key stays unique while open
        self._by_storage = {}
        self._replaced = WeakIdKeyDictionary()  # original parameter -> placeholder
        self._cached = None    # (placeholder param, full values)
        self._hook = None

    # ---- entering and leaving ------------------------------------------------

    def __enter__(self):
        # The gathers need a process group. One made here (a one-process
        # group when no launcher is set) is left for zero.initialize to
        # reuse, and stays for the life of the process (one reference,
        # however often a notebook cell runs this); where CUDA is
        # present it gets NCCL too (connected only when first used), for
        # an engine that trains the model on a GPU (initialize(device=)).
        gpu = torch.cuda.is_available() and nccl_available()
        world = int(os.environ.get("WORLD_SIZE", 1))
        join_for_the_process(torch.device("cpu"),
                             backend_for(torch.device("cuda" if gpu else "cpu"), world))
        self._comm = Comm(torch.device("cpu"))  # the process's group
        self.rank, self.world = self._comm.rank, self._comm.world
        self._check_same_seed()
        self._hook = nn.modules.module.register_module_parameter_registration_hook(
            self._on_register)
        self._buffer_hook = nn.modules.module.register_module_buffer_registration_hook(
            self._on_register_buffer)
        self._records = []
        self._progress = bar("partitioned construction", unit="param", enabled=self.rank == 0)
        entered = super().__enter__()
        # ops torch decomposes through strides before this mode sees them
        self._before = BeforeDecomposition(self)
        self._before.__enter__()
        return entered

    def __exit__(self, *exc):
        try:
            self._evict()
            if exc[0] is None:
                self._check_same_seed("leaving")
                self._take_data_given()
        finally:
            self._before.__exit__(None, None, None)
            # it refers back to this context: a cycle that would keep the
            # records, and with them every chunk, until Python's collector ran
            self._before = None
            self._progress.close()
            self._hook.remove()
            self._buffer_hook.remove()
            self._by_storage.clear()
            mine = {id(record) for record in self._records}
            for param, record in list(_registry.items()):
                if id(record) in mine and storage_key(param) != record.key:
                    # given other data inside the context (module.half()): its
                    # own values count, whatever happens to it later
                    del _registry[param]
                elif id(record) in mine:
                    record.version = param._version  # a later write bumps it
            for record in self._records:
                record.closed = True
            # the registry holds them for initialize, which frees each
            # chunk as it takes it; a context kept by the caller must not
            self._records = []
            super().__exit__(*exc)
        return False

    def _take_data_given(self):
        """A parameter given a placeholder's data inside the context (p.data
        = q.data, HuggingFace's resize_token_embeddings; p.data = f(p.data)
        in a ViT's _init_weights): it would read that placeholder's zeros.
        It gets the values the data stands for, in a record of its own (a
        copy: p.data = q.data ties nothing here; tie as modules do, p = q).
        Collectives, in the same order on every rank."""
        mine = {id(record) for record in self._records}
        for param, record in list(_registry.items()):
            if id(record) not in mine or storage_key(param) == record.key:
                continue
            found = self._by_storage.get(storage_key(param))
            if found is None or found[1].base not in _registry:
                continue  # other data of its own: it counts (module.half())
            with torch.no_grad():  # nothing is cached now: _resolve gathers
                real = self._resolve(param, None, False)
                given = _Sharded(real.contiguous(), self.rank, self.world, self._directory)
                del real
            ph = _placeholder(given.shape, given.dtype)
            given.storage, given.key, given.closed = ph.untyped_storage(), storage_key(ph), False
            param.data = ph
            self._records.append(given)
            _registry[param] = given

    def _check_same_seed(self, when="entering"):
        """Entering: the same random state on every rank. Leaving: the same
        state and as many parameters built (a module built on some ranks
        only drew from one rank's stream and not the others')."""
        if self.world == 1:
            return
        state = torch.random.get_rng_state().numpy().tobytes()
        if when == "leaving":
            state += len(self._records).to_bytes(8, "little")
        digest = hashlib.sha256(state).digest()[:8]
        mine = int.from_bytes(digest, "little") & (2**62 - 1)
        if any(value != mine for value in self._comm.gather_scalars(mine)):
            if when == "leaving":
                raise RuntimeError(
                    "zero.partitioned_init(): leaving it, the ranks differ in their random "
                    "state or in how many parameters they built: every rank must run the "
                    "same construction code inside it (a module built under `if rank == "
                    "0:` draws one rank's random numbers; build it outside the context)")
            raise RuntimeError(
                "zero.partitioned_init() needs the same random state on every rank (the "
                "ranks build the parameters together): call torch.manual_seed(seed) with "
                "the same seed on every rank before entering it")

    # ---- parameter registration ------------------------------------------------

    def _on_register(self, module, name, param):
        if param is None or param in _registry:
            return None  # tied or re-registered: already a placeholder
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise TypeError(
                f"zero.partitioned_init(): {type(module).__name__}.{name} is a lazy parameter "
                "(nn.LazyLinear and its kind), which has no shape until a first forward; "
                "give the module its input size (nn.Linear), or build it outside the context")
        # the last registered parameter's full values, given back to the
        # system: glibc keeps freed blocks resident (release_freed_memory),
        # and in memory as on a disk a rank holds its chunks plus one
        # parameter (the in-memory route held nearly the whole model)
        release_freed_memory()
        if param in self._replaced:
            return self._replaced[param]  # the same parameter given to a second module
        with torch.no_grad():
            record = _Sharded(param.detach(), self.rank, self.world, self._directory)
        ph = _placeholder(param.shape, param.dtype, param.requires_grad)
        # The record holds the placeholder's storage, so its key cannot be
        # reused by another tensor while the record lives, even if the
        # parameter is given other data (p.data = ..., module.half()).
        record.storage = ph.untyped_storage()
        record.key = storage_key(ph)
        record.closed = False
        self._records.append(record)
        self._progress.update(1)
        _registry[ph] = record
        self._replaced[param] = ph
        self._by_storage[record.key] = (ph, _LazyView(ph, []))
        return ph

    def _on_register_buffer(self, module, name, buffer):
        """A buffer made from a placeholder without an op that computes new
        values (self.register_buffer("w0", self.lin.weight.detach())) would
        alias the parameter's memory, which is partitioned: refused."""
        if buffer is not None and self._tracked(buffer) is not None:
            raise ValueError(
                f"buffer '{name}' of {type(module).__name__} is the memory of a parameter built "
                "in zero.partitioned_init() (a detach or view of it), which each rank holds "
                "only 1/N of; register a copy (.clone()) instead")
        return None

    # ---- resolving placeholders ---------------------------------------------------

    def _full(self, param, overwrite=False):
        """The full values of a placeholder parameter, cached until another
        parameter is touched."""
        if self._cached is not None and self._cached[0] is param:
            return self._cached[1]
        self._evict()
        record = _registry[param]
        full = torch.empty(record.shape, dtype=record.dtype) if overwrite else record.gather()
        self._cached = (param, full)
        return full

    def _evict(self):
        if self._cached is not None:
            param, full = self._cached
            _registry[param].store(full)
            self._cached = None
            del full
            release_freed_memory()  # one parameter's values at a time, really

    def _tracked(self, t):
        """(owner, _LazyView) when t is a placeholder, a view made from one,
        or an alias of either (w.data shares the placeholder's storage)."""
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return None
        return self._by_storage.get(storage_key(t))

    def _resolve(self, t, primary, overwrite):
        """The real tensor for t: the cached full values for the primary
        parameter (the one the op writes, else the first it reads), a
        temporary gather for any other placeholder."""
        found = self._tracked(t)
        if found is None:
            return t
        _, view = found
        if view.base is primary:
            real = self._full(primary, overwrite and _whole(view.chain))
        else:
            real = _registry[view.base].gather()
        for op, args, kwargs in view.chain:
            real = op(real, *args, **kwargs)
        return real

    # ---- the dispatch hook ----------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # nested too: cat, stack and the _foreach ops take lists of tensors
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        tracked = [self._tracked(t) for t in tensors]
        if not any(f is not None for f in tracked):
            return func(*args, **kwargs)
        if func.is_view and args and self._tracked(args[0]) is not None:
            return self._view(func, args, kwargs)
        target = self._written(func, args, kwargs)
        if isinstance(target, (list, tuple)):
            # _foreach_*_ over parameters: only one full copy is cached at a
            # time, so writes to the others would go to temporaries
            if any(self._tracked(t) is not None for t in target):
                raise RuntimeError(
                    f"zero.partitioned_init(): {func} writes a list of tensors that holds "
                    "parameters built in the context; each rank holds 1/N of them, one at "
                    "a time: apply the op to each parameter in turn")
            target = None
        found = self._tracked(target)
        primary = (found or next(f for f in tracked if f is not None))[1].base
        # (module.weight.data.normal_(): HuggingFace's init writes through .data)
        overwrite = func in _OVERWRITES and found is not None and target is args[0] \
            and _whole(found[1].chain)
        # the primary's full values first: this may store the previous
        # cached parameter's chunk, which a temporary gather then reads
        self._full(primary, overwrite)
        real_args = tree_map(lambda a: self._resolve(a, primary, overwrite and a is target),
                             args)
        real_kwargs = tree_map(lambda a: self._resolve(a, primary, False), kwargs)
        out = func(*real_args, **real_kwargs)
        returns = func._schema.returns
        if target is not None and returns and returns[0].alias_info is not None \
                and returns[0].alias_info.is_write:
            return target  # an in-place or out= op returns its (placeholder) target
        return out

    @staticmethod
    def _written(func, args, kwargs):
        """The tensor an in-place or out= op writes, or None."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                if i < len(args) and not arg.kwarg_only:
                    return args[i]
                return kwargs.get(arg.name)
        return None

    def _view(self, func, args, kwargs):
        _owner, view = self._tracked(args[0])
        step = (func, tuple(args[1:]), dict(kwargs))
        # the view's shape, found on the meta device without touching data
        probe = torch.empty(_registry[view.base].shape, dtype=args[0].dtype, device="meta")
        for op, a, k in view.chain + [step]:
            probe = op(probe, *a, **k)
        if isinstance(probe, (list, tuple)):  # chunk, split, unbind: one view each
            return type(probe)(self._view_placeholder(
                view, [(functools.partial(_nth_view, func, i), step[1], step[2])], p)
                for i, p in enumerate(probe))
        return self._view_placeholder(view, [step], probe)

    def _view_placeholder(self, view, steps, probe):
        ph = _placeholder(probe.shape, probe.dtype)
        self._by_storage[storage_key(ph)] = (ph, _LazyView(view.base, view.chain + steps))
        return ph


def _nth_view(func, i, tensor, *args, **kwargs):
    """Output i of a view op that returns several (chunk, split, unbind)."""
    return func(tensor, *args, **kwargs)[i]


def sharded_record(param):
    """The _Sharded record of a placeholder made by partitioned_init, or
    None. A parameter given other data since (p.data = ..., module.half()
    inside the context) is no longer a placeholder: its record is dropped
    and its own values count. A cast or a copy after the context closed
    (the same shape: model.to(torch.bfloat16), or model.to("cpu:0"), which
    the HF Trainer makes under torchrun, before initialize) read the
    placeholder's zeros; the record is kept and its values are cast. A
    copy in the same dtype is told from new data by its values: all zero
    ([Note: placeholders copied after the context])."""
    record = _registry.get(param)
    if record is not None and storage_key(param) != record.key:
        if record.closed and param.shape == record.shape and \
                (param.dtype != record.dtype or not param.detach().count_nonzero()):
            # [Note: placeholders copied after the context] model.to(dtype)
            # or .to(device) after the context: a cast or copy of the
            # placeholder's zeros (a copy to "cpu:0" trained a model of
            # zeros, silently). The values are the chunks', cast alike. A
            # parameter set to zeros after the context in its own dtype
            # (p.data = torch.zeros(...)) reads the same and takes its
            # built values: zero it inside the context, or after initialize.
            record.key, record.storage = storage_key(param), param.untyped_storage()
            record.cast_to = param.dtype
        else:
            del _registry[param]
            return None
    if record is not None:
        # writes inside the context never reach a placeholder's storage; a
        # one-element placeholder (the only kind that accepts a write) that
        # is not zero was written after the context closed, and that write
        # would be lost
        stored = torch.empty(0, dtype=param.dtype).set_(param.untyped_storage(), 0, (1,))
        if stored.item() != 0 or param._version != getattr(record, "version", param._version):
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} built in zero.partitioned_init() "
                "was written after the context closed; the write would be lost. Build the "
                "model again (this one keeps the lost write) and write it inside the "
                "context, or after zero.initialize through "
                "zero.GatheredParameters(..., modifier_rank=0)")
    return record


def built_in_order(entries) -> list:
    """(placeholder, record) pairs in the order the parameters were built,
    the same on every rank (a caller's set of parameters is ordered by
    ids, which differ per process): the order their gathers go in."""
    position = {id(param): i for i, param in enumerate(_registry.keys())}
    return sorted(entries, key=lambda entry: position.get(id(entry[0]), -1))


def take_values(param):
    """The full values of a placeholder (a collective), after which the
    record is dropped; any other tensor is returned as it is."""
    record = sharded_record(param)
    if record is None:
        return param.detach()
    values = record.gather()
    del _registry[param]
    return values.to(getattr(record, "cast_to", record.dtype))

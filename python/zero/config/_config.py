"""zero.Config: the engine's settings as one frozen dataclass, and the reader
of DeepSpeed-style JSON configs (Config.from_deepspeed), so DeepSpeed users
can bring theirs. Unknown keys are reported by their full dotted name."""
from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from zero.config._deepspeed_config import read_deepspeed, translate
from zero.config._deepspeed_keys import check_aio, check_monitor
from zero.config._values import _enabled, _number, _seconds

PRECISIONS = ("fp32", "bf16", "fp16")
# each precision's torch dtype (the compute dtype; grad_accum_dtype's and
# buffer_dtype's names too)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# 500M elements is DeepSpeed's default bucket; on the CPU/gloo path a bucket
# of 25M elements (50 MB in bf16) already amortises the per-call cost of a
# collective (tens of microseconds) over milliseconds of transfer, while
# keeping the transient bucket memory small beside a 2-14 bytes/param budget.
DEFAULT_BUCKET_ELEMENTS = 25_000_000

# Stage 3 defaults, in elements, with DeepSpeed's names and meanings. A unit
# (one module's parameters) at or below the persistence threshold stays
# gathered: re-gathering a LayerNorm costs more in latency than its bytes.
# Prefetch gathers ahead of use while the units gathered ahead fit in the
# prefetch bucket and every live gathered unit fits in max_live.
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
DEFAULT_PREFETCH_ELEMENTS = 50_000_000
DEFAULT_MAX_LIVE_ELEMENTS = 1_000_000_000

# The largest finite fp32 number, (2 - 2**-23) * 2**127, and the largest
# power of two below it: the bounds of a loss scale, which is applied in fp32.
FP32_MAX = float.fromhex("0x1.fffffep+127")
FP32_MAX_POWER = 127


@dataclass(frozen=True)
class LossScaling:
    """fp16 dynamic loss scaling (DeepSpeed's defaults and semantics)."""

    initial_scale_power: int = 16     # initial scale 2**16
    loss_scale_window: int = 1000     # steps without overflow before doubling
    hysteresis: int = 2               # overflows tolerated before halving
    min_loss_scale: float = 1.0
    static_loss_scale: float = 0.0    # > 0: a fixed scale, no dynamic changes
    # True: any step without overflow restores the hysteresis, so only
    # `hysteresis` overflows in a row halve the scale
    consecutive_hysteresis: bool = False

    def __post_init__(self):
        # DeepSpeed configs write 16.0 or 1e3 for these integers: taken
        # when integral, as DeepSpeed's own parsing does
        for name, low in (("initial_scale_power", 0), ("loss_scale_window", 1),
                          ("hysteresis", 1)):
            value = _number(getattr(self, name), f"loss_scaling.{name}")
            if value != int(value) or value < low:
                raise ValueError(f"loss_scaling.{name} must be an integer >= {low}, got "
                                 f"{getattr(self, name)!r}")
            object.__setattr__(self, name, int(value))
        # the scale multiplies the loss and divides the gradients in fp32: a
        # scale fp32 cannot hold is inf there, every gradient overflows and
        # every step is skipped (2**1000 was taken, and trained nothing)
        if self.initial_scale_power > FP32_MAX_POWER:
            raise ValueError(
                f"loss_scaling.initial_scale_power (fp16.initial_scale_power in a DeepSpeed "
                f"config) must be an integer from 0 to {FP32_MAX_POWER}, got "
                f"{self.initial_scale_power}: the initial loss scale 2**"
                f"{self.initial_scale_power} is not finite in fp32, whose largest power of two "
                f"is 2**{FP32_MAX_POWER}. DeepSpeed's default is 16")
        # 0 is common for both; a dynamic fp16 scale needs min_loss_scale > 0
        # (Config checks it: only it knows the precision)
        for name, key in (("min_loss_scale", "min_loss_scale"),
                          ("static_loss_scale", "loss_scale")):
            value = _number(getattr(self, name), f"loss_scaling.{name}")
            if value < 0:
                raise ValueError(f"loss_scaling.{name} must be >= 0, got {value!r}")
            if value > FP32_MAX:
                raise ValueError(
                    f"loss_scaling.{name} (fp16.{key} in a DeepSpeed config) must be from 0 "
                    f"to {FP32_MAX!r}, the largest fp32 number, got {value!r}: the loss "
                    "scale is applied in fp32, where this value is inf")
        if not isinstance(self.consecutive_hysteresis, bool):
            raise ValueError("loss_scaling.consecutive_hysteresis must be true or false, got "
                             f"{self.consecutive_hysteresis!r}")


@dataclass(frozen=True)
class OffloadOptimizer:
    """Where the optimizer states (and the fp32 master, when it is not the
    parameters) live. "none" and "cpu": in host memory, where a CPU-trained
    model's states already are. "nvme": in files under nvme_path, mapped
    into memory and paged through in chunks of chunk_elements during the
    step; write_through also keeps them out of the page cache, so every
    step reads and writes them on the disk. delayed_update: the host update
    of step k runs on a thread while step k+1's forward and backward
    compute, whose gradients are then taken one update late (ZeRO-Offload's
    delayed parameter update; for a model on a GPU, or a CPU model with its
    states in files; docs/offload.md)."""

    device: str = "none"
    nvme_path: Optional[str] = None
    chunk_elements: int = 1 << 22  # 16 MiB of each fp32 state in RAM at a time
    write_through: bool = False
    delayed_update: bool = False

    def __post_init__(self):
        object.__setattr__(self, "nvme_path",
                           _offload_place("offload_optimizer", self.device, self.nvme_path))
        # numpy's integers too (a size computed with numpy)
        if isinstance(self.chunk_elements, bool) or \
                not isinstance(self.chunk_elements, numbers.Integral) or self.chunk_elements < 1:
            raise ValueError("offload_optimizer.chunk_elements must be a positive integer, got "
                             f"{self.chunk_elements!r}")
        object.__setattr__(self, "chunk_elements", int(self.chunk_elements))
        for name in ("write_through", "delayed_update"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"offload_optimizer.{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")
        if self.delayed_update and self.device == "none":
            raise ValueError("offload_optimizer.delayed_update needs the states apart from "
                             "the model: device 'nvme' (its disk reads and writes overlap the "
                             "next forward and backward), or for a model on a GPU 'cpu' too "
                             "(the host update overlaps the GPU's)")


@dataclass(frozen=True)
class OffloadParam:
    """Where stage 3 keeps this rank's shard of the parameters between
    gathers. "none": on the model's device. "cpu": in host memory (a CPU
    model's is there already; a GPU model's is page-locked, and each
    unit's chunk is copied to the GPU before its gather). "nvme": in a file
    per group under nvme_path, mapped into memory; a gather reads its unit's
    slice, and the pages are dropped again once the unit is gathered and
    after each step, so RAM holds only what is being read or written
    (docs/offload.md, "Parameters on a disk" and "Parameters off the GPU")."""

    device: str = "none"
    nvme_path: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "nvme_path",
                           _offload_place("offload_param", self.device, self.nvme_path))


def _offload_place(block, device, nvme_path):
    """The checks of an offload block's device and nvme_path (block: its
    name, for messages); returns nvme_path as a str (or None). The
    directory itself is checked where it is used (check_nvme_path, at
    initialize): a config may be read, or a run sized, elsewhere."""
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"{block}.device must be 'none', 'cpu' or 'nvme', got {device!r}")
    path = None if nvme_path is None else _path(nvme_path, f"{block}.nvme_path")
    if device == "nvme" and not path:
        raise ValueError(f"{block}.device='nvme' needs nvme_path, a directory on a fast disk")
    return path


def _path(value, name) -> str:
    """A str or os.PathLike path, as a str. Bytes are refused: the files
    under it are named with str."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        raise TypeError(f"{name} must be a str or an os.PathLike path, got "
                        f"{type(value).__name__} {value!r}")
    return path


def check_nvme_path(path, name="offload_optimizer.nvme_path"):
    """An nvme_path must be a directory this process can create files in."""
    path = _path(path, name)
    if not os.path.isdir(path):
        raise ValueError(f"{name} {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path!r} is not writable")


# more elements than any bucket holds; above 2^63 the C core's sizes overflowed
_MOST_ELEMENTS = 2**48


@dataclass(frozen=True)
class Config:
    """Everything zero.initialize takes besides the model and optimizer:
    give its fields as keyword arguments to initialize, or a Config or a
    DeepSpeed config (a dict in DeepSpeed's keys, or a JSON file's path) as
    `config`. Fields keep
    DeepSpeed's names where DeepSpeed has one (docs/engine.md, "DeepSpeed
    config keys"); the defaults are in the signature."""
    stage: int = 2
    precision: str = "fp32"
    # None: derived at initialize from train_batch_size (DeepSpeed's rule)
    gradient_accumulation_steps: Optional[int] = 1
    gradient_clipping: float = 0.0
    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS
    # how a gradient bucket reaches its owners: "reduce" (one reduce per
    # rank whose partition it overlaps), "reduce_scatter" (one
    # reduce_scatter for a bucket that holds whole units), or "auto"
    # (reduce_scatter on NCCL, reduce elsewhere: docs/engine.md, "Buckets")
    bucket_reduction: str = "auto"
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    stage3_param_persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD
    # at most this many elements persistent in all (DeepSpeed's
    # stage3_model_persistence_threshold); None: no cap. Units are taken in
    # layout order ([Note: persistence] in sharding/_units.py)
    stage3_model_persistence_threshold: Optional[int] = None
    stage3_prefetch_bucket_size: int = DEFAULT_PREFETCH_ELEMENTS
    stage3_max_live_parameters: int = DEFAULT_MAX_LIVE_ELEMENTS
    # a unit whose next use comes within this many gathered elements is
    # kept at the end of its forward instead of released (DeepSpeed's key;
    # its default is 1e9, ours 0: released right after use. [Note: reuse
    # distance] in sharding/_pass_order.py)
    stage3_max_reuse_distance: int = 0
    # modules (class names or classes) gathered whole at stage 3: one unit
    # of all the parameters below each, no hooks inside (a mixture-of-
    # experts block, whose experts run or not depending on each rank's data)
    stage3_leaf_modules: tuple = ()
    # what stage 3 gathers as one unit: "block" (the model's repeated blocks,
    # each one unit), "module" (each module's own parameters), classes or
    # class names, or a callable(module) -> bool naming the unit roots
    # ([Note: units by block] in sharding/_unit_roots.py)
    units: object = "block"
    train_micro_batch_size_per_gpu: Optional[int] = None
    train_batch_size: Optional[int] = None  # checked against micro * accumulation * world
    # engine.deepspeed_io's DataLoader drops a last, partial batch (DeepSpeed's key)
    dataloader_drop_last: bool = False
    # DeepSpeed's key, answered by engine.steps_per_print() for a script's
    # own logging; zero prints no periodic progress line of its own
    steps_per_print: Optional[int] = None
    loss_scaling: LossScaling = field(default_factory=LossScaling)
    offload_optimizer: OffloadOptimizer = field(default_factory=OffloadOptimizer)
    offload_param: OffloadParam = field(default_factory=OffloadParam)  # stage 3 only
    # the dtype gradients accumulate in (None: the compute dtype); "fp32"
    # keeps the sum of many bf16 micro-batches exact to fp32 for 2 more
    # bytes per gradient element
    grad_accum_dtype: Optional[str] = None
    # the dtype of the model's floating buffers (None: each keeps its own;
    # DeepSpeed's data_types.buffer_dtype). Batch/instance norms' running
    # statistics follow the precision whatever this says ([Note: buffer
    # dtypes] in engine/_construction.py)
    buffer_dtype: Optional[str] = None
    # skip a bf16/fp32 step whose gradients hold an inf or nan, as fp16's
    # loss scaling always does (DeepSpeed's bf16.check_grad_overflow)
    check_grad_overflow: bool = False
    optimizer: Optional[dict] = None  # {"type": "AdamW", "params": {...}}
    scheduler: Optional[dict] = None  # {"type": "WarmupLR", "params": {...}}
    # DeepSpeed's monitor blocks: {"tensorboard"|"csv_monitor"|"wandb": {...}}
    # (engine/_monitor.py); a DeepSpeed config's top-level blocks land here
    monitor: Optional[dict] = None
    # the disk engine's block_size and queue_depth for offload "nvme" (a
    # DeepSpeed config's "aio" block: offload/_aio.py); process-wide
    aio: Optional[dict] = None
    # seconds (or a datetime.timedelta) a collective on a process group zero
    # makes waits for the other ranks before it fails, naming this setting;
    # None: 10 minutes, or beside a default group the user made, that
    # group's own (docs/engine.md, "Timeouts"). A DeepSpeed-style config's
    # "comms_timeout" (DeepSpeed has no key for it)
    timeout: Optional[float] = None

    def __post_init__(self):
        object.__setattr__(self, "timeout", _seconds(self.timeout, "timeout"))
        if not isinstance(self.dataloader_drop_last, bool):
            raise ValueError(f"dataloader_drop_last must be true or false, got "
                             f"{self.dataloader_drop_last!r}")
        object.__setattr__(self, "monitor", check_monitor(self.monitor, _enabled) or None)
        object.__setattr__(self, "aio", check_aio(self.aio))
        leaves = self.stage3_leaf_modules
        if isinstance(leaves, (str, type)):
            leaves = (leaves,)
        if not isinstance(leaves, (list, tuple)) or \
                not all(isinstance(x, (str, type)) for x in leaves):
            raise ValueError("stage3_leaf_modules must be a list of module classes or class "
                             f"names, got {self.stage3_leaf_modules!r}")
        object.__setattr__(self, "stage3_leaf_modules", tuple(leaves))
        units = self.units
        if isinstance(units, list):
            units = tuple(units)
        if isinstance(units, type):
            units = (units,)
        valid = units in ("block", "module") or \
            (isinstance(units, tuple) and units and
             all(isinstance(x, (str, type)) for x in units)) or \
            (callable(units) and not isinstance(units, (str, tuple)))
        if not valid:
            raise ValueError("units must be 'block', 'module', a list of module classes or "
                             f"class names, or a callable(module) -> bool; got {self.units!r}")
        object.__setattr__(self, "units", units)
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        object.__setattr__(self, "stage", int(self.stage))  # 3.0 from a JSON writer
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        for name in ("train_micro_batch_size_per_gpu", "train_batch_size", "steps_per_print"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.gradient_accumulation_steps is None:
            if self.train_batch_size is None:
                raise ValueError("gradient_accumulation_steps is None (derive it) but "
                                 "train_batch_size, which it is derived from, is not given")
        elif isinstance(self.gradient_accumulation_steps, bool) or \
                not isinstance(self.gradient_accumulation_steps, int) or \
                self.gradient_accumulation_steps < 1:
            raise ValueError("gradient_accumulation_steps must be an integer >= 1, got "
                             f"{self.gradient_accumulation_steps!r}")
        if not isinstance(self.check_grad_overflow, bool):
            raise ValueError(f"check_grad_overflow must be true or false, got "
                             f"{self.check_grad_overflow!r}")
        if not _number(self.gradient_clipping, "gradient_clipping") >= 0:
            raise ValueError(f"gradient_clipping must be >= 0, got {self.gradient_clipping!r}")
        if isinstance(self.reduce_bucket_size, bool) or \
                not isinstance(self.reduce_bucket_size, int) or \
                not 1 <= self.reduce_bucket_size <= _MOST_ELEMENTS:
            raise ValueError(f"reduce_bucket_size must be an integer from 1 to 2^48 "
                             f"(elements), got {self.reduce_bucket_size!r}")
        if self.bucket_reduction not in ("auto", "reduce", "reduce_scatter"):
            raise ValueError(f"bucket_reduction must be 'auto', 'reduce' or 'reduce_scatter', "
                             f"got {self.bucket_reduction!r}")
        if self.buffer_dtype is not None and self.buffer_dtype not in PRECISIONS:
            raise ValueError(f"buffer_dtype must be None (each buffer keeps its dtype) or one "
                             f"of {PRECISIONS}, got {self.buffer_dtype!r}")
        if self.grad_accum_dtype not in (None, "fp32", self.precision):
            raise ValueError(f"grad_accum_dtype must be None, 'fp32' or the precision "
                             f"({self.precision!r}), got {self.grad_accum_dtype!r}")
        # the keyword form of the nested blocks: plain dicts
        for name, block in (("loss_scaling", LossScaling),
                            ("offload_optimizer", OffloadOptimizer),
                            ("offload_param", OffloadParam)):
            value = getattr(self, name)
            if value is None:  # as left out
                value = {}
            if isinstance(value, dict):
                known = {f.name for f in fields(block)}
                unknown = sorted(set(value) - known)
                if unknown:
                    raise ValueError(f"{name} has no field {unknown[0]!r}; its fields are "
                                     f"{sorted(known)}")
                object.__setattr__(self, name, block(**value))
            elif not isinstance(value, block):
                raise ValueError(f"{name} must be a dict or a zero.config.{block.__name__}, "
                                 f"got {value!r}")
        scaling = self.loss_scaling
        if self.precision == "fp16" and scaling.static_loss_scale == 0 and \
                scaling.min_loss_scale <= 0:
            # DeepSpeed 0.19.8 refuses it too: overflows would halve the
            # scale to 0, and the step then divides by it
            raise ValueError("loss_scaling.min_loss_scale (a DeepSpeed config's "
                             "fp16.min_loss_scale) must be > 0 with dynamic fp16 loss scaling, "
                             f"got {scaling.min_loss_scale!r}; DeepSpeed's default is 1")
        for name in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
                     "stage3_max_live_parameters", "stage3_max_reuse_distance"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (elements), got {value!r}")
        cap = self.stage3_model_persistence_threshold
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError("stage3_model_persistence_threshold must be an integer >= 0 "
                             f"(elements) or None (no cap), got {cap!r}")
        if self.offload_param.device != "none" and self.stage != 3:
            # DeepSpeed reads offload_param at stage 3 only; at stages 0-2
            # every rank holds all the parameters, so there is no shard
            raise ValueError(f"offload_param (device {self.offload_param.device!r}) needs "
                             f"stage 3, where the parameters are partitioned; the stage is "
                             f"{self.stage}")

    def replace(self, **changes) -> "Config":
        """A copy with `changes`; a dict for loss_scaling, offload_optimizer
        or offload_param changes those fields of the block and keeps the
        rest (a config file's fp16 block, say)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; known: "
                            f"{sorted(f.name for f in dataclasses.fields(self))}")
        for name in ("loss_scaling", "offload_optimizer", "offload_param"):
            if isinstance(changes.get(name), dict):
                changes[name] = {**dataclasses.asdict(getattr(self, name)), **changes[name]}
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_deepspeed(cls, config: "dict | str | os.PathLike") -> "Config":
        """Read a DeepSpeed JSON config (a dict or a path to a JSON file)."""
        options = translate(read_deepspeed(config))
        for name, kind in (("loss_scaling", LossScaling), ("offload_optimizer", OffloadOptimizer),
                           ("offload_param", OffloadParam)):
            if isinstance(options.get(name), dict):
                options[name] = kind(**options[name])
        return cls(**options)

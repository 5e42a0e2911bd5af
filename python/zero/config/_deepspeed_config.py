"""DeepSpeed JSON configs read as DeepSpeed 0.19.8 reads them, into
zero.Config's fields (Config.from_deepspeed): the keys taken, those
accepted without effect (with the reason), "auto" values, the fp16/bf16
blocks, offload blocks, and a refusal that names every other key
(_deepspeed_keys.py says which are DeepSpeed's). It gives Config's
keyword arguments as plain values; Config.from_deepspeed builds the
LossScaling and offload blocks."""
from __future__ import annotations

import json
import os
from typing import Any

from zero.config._values import _enabled, _enabled_or_kept, _number, _seconds, auto_refused
from zero.config._deepspeed_keys import (MONITORS, drop_disabled, drop_inert,
                                         drop_inert_zero, refusal, stage3_names,
                                         take_cpu_offload, warn_no_timers,
                                         warn_unread_monitor)


def read_deepspeed(config) -> dict:
    """The dict of a DeepSpeed config given as a dict or a JSON file's path."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):  # open() would take an int as an fd
        raise TypeError(f"config must be a dict, a path to a JSON file or a zero.Config, got "
                        f"{type(config).__name__}")
    with open(config, encoding="utf-8") as f:
        try:
            loaded = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"config file {os.fspath(config)!r} is not valid JSON (UTF-8): "
                             f"{error}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {os.fspath(config)!r} holds a JSON "
                         f"{type(loaded).__name__}, not an object of DeepSpeed keys")
    return loaded


# HuggingFace's DeepSpeed templates write "auto" where its Trainer fills in a
# value. Ours: the sizes below take zero's defaults (tuning, not results);
# the batch sizes, used only for a consistency check, are left out; keys
# whose value changes the training (accumulation, clipping) are refused
# with the reason, as an optimizer or scheduler parameter is.
_AUTO_MEANS_DEFAULT = {"reduce_bucket_size", "stage3_param_persistence_threshold",
                       "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                       "stage3_max_reuse_distance", "overlap_comm", "contiguous_gradients",
                       "train_batch_size", "train_micro_batch_size_per_gpu"}


# the other "auto"s HuggingFace's integration fills in (besides the sizes
# above, the optimizer's and scheduler's parameters and the fp16/bf16
# switches, refused where those are read)
_AUTO_FROM_HUGGINGFACE = {"gradient_accumulation_steps", "gradient_clipping"}


def _drop_auto(block: dict, prefix: str, ignored: set) -> dict:
    """block without its "auto" values: each one taken as zero's default,
    or of a key that has no effect here (ignored), or refused, saying who
    fills it in (HuggingFace's integration) or that no one does."""
    out = {}
    for key, value in block.items():
        if value != "auto":
            out[key] = value
        elif key in _AUTO_FROM_HUGGINGFACE:
            raise auto_refused(f"{prefix}{key}")
        elif key not in _AUTO_MEANS_DEFAULT and key not in ignored:
            raise ValueError(f"{prefix}{key} is 'auto', which neither DeepSpeed nor "
                             "HuggingFace's DeepSpeed integration fills in; give a value")
    return out


# DeepSpeed keys that are accepted and have no effect here, with the reason
# kept for the docs (docs/engine.md).
_IGNORED = {
    "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
    "gradient_predivide_factor", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    # DeepSpeed's own timers and garbage-collection pauses; "log_level" is
    # zero.deepspeed.initialize's (its logger's level), not the engine's
    "log_level", "timers", "disable_python_gc",
    # its pre-ZeRO gather switch; zero's stages gather as they need
    "disable_allgather",
    # names of DeepSpeed's config object's attributes, not keys it reads
    # (LLaMA-Factory's shipped configs write both): DeepSpeed 0.19.8 runs
    # no monitor and no comms logger from them, and neither does zero
    # (warn_unread_monitor says so when one asks for a monitor)
    "comms_config", "monitor_config",
}
_ZERO_IGNORED = {
    "allgather_partitions", "allgather_bucket_size", "reduce_scatter", "round_robin_gradients",
    "load_from_fp32_weights", "elastic_checkpoint", "sub_group_size",
    # ZeroTrainer.save_model always writes the whole model (from the fp32
    # masters), and engine checkpoints are sharded
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",  # its deprecated name
    # stages 1-2 let unused parameters be; zero finds them by itself
    # ([Note: expected gradients] in sharding/_buckets.py)
    "ignore_unused_parameters",
    # DeepSpeed's stage-1 code path of old; the stage's result is the same
    "legacy_stage1",
    # how DeepSpeed's own stage 3 fetches and reduces: its bucket
    # all-reduce across ranks, fine-grained modules fetched whole, fetches
    # by all-reduce or one parameter at a time, zero.Init's streaming chunk
    # (zero's units are its own: units=, stage3_leaf_modules; [Note: units
    # by block])
    "use_multi_rank_bucket_allreduce", "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
    "stage3_partition_stream_chunk_size",
    # DeepSpeed's stage-3 linear (torch's autograd saves nothing gathered
    # here: [Note: saved parameters]) and its nn.Module.apply patch under
    # zero.Init (partitioned_init gathers for apply itself), its pipeline-
    # mode checkpoint loading, trace-cache warnings and internal checks
    "memory_efficient_linear", "override_module_apply", "pipeline_loading_checkpoint",
    "log_trace_cache_warnings", "enable_sanity_checks",
    # the Muon optimizer's buffer placement with NVMe (Muon is not offered)
    "save_muon_momentum_buffer_in_memory",
}


def _print_interval(value):
    """steps_per_print for engine.steps_per_print(): a positive whole number
    (1e5 from a JSON writer too); anything else is dropped as before it was
    read (DeepSpeed reads it unchecked, and zero prints nothing by it)."""
    if isinstance(value, float) and value.is_integer() and value >= 1:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def _take(block: dict, prefix: str, known: dict, ignored=frozenset()) -> dict:
    """Map block's keys through `known` (DeepSpeed name -> our name, or None
    to drop); raise on any key neither known nor ignored."""
    out, unknown = {}, []
    for key, value in block.items():
        if key in known:
            if known[key] is not None:
                out[known[key]] = value
        elif key not in ignored:
            unknown.append(f"{prefix}{key}")
    if unknown:
        raise refusal(unknown, [f"{prefix}{k}" for k in (*known, *ignored)])
    return out


# DeepSpeed's names of a dtype (its DtypeEnum), by ours
DTYPE_NAMES = {"fp32": ("fp32", "float32", "float", "torch.float32"),
                "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
                "fp16": ("fp16", "float16", "half", "torch.float16")}


def dtype_name(value, key: str) -> str:
    """zero's name ("fp32", "bf16", "fp16") of a dtype a config names the
    way DeepSpeed reads it."""
    for ours, names in DTYPE_NAMES.items():
        if value in names:
            return ours
    raise ValueError(f"{key} must name fp32, bf16 or fp16 (DeepSpeed's spellings: "
                     f"{', '.join(n for names in DTYPE_NAMES.values() for n in names)}), "
                     f"got {value!r}")


def _offload_options(zero_block, key, ignored):
    """A DeepSpeed offload block (zero_optimization.<key>) as the keyword
    arguments of zero's (Config.from_deepspeed builds it), or None when it
    is left out; `ignored`: DeepSpeed's tuning keys it accepts and drops."""
    block = zero_block.get(key)
    if block is not None and not isinstance(block, dict):
        raise ValueError(f"zero_optimization.{key} must be an object such as "
                         f'{{"device": "cpu"}}, got {block!r}')
    if not block:
        return None
    offload = _take(block, f"zero_optimization.{key}.",
                    {"device": "device", "nvme_path": "nvme_path"}, ignored)
    if offload.get("device") == "auto":  # as DeepSpeed: no offload
        offload.pop("device")
    return offload


def translate(ds: dict) -> dict:
    top = dict(ds)
    options: dict[str, Any] = {}
    zero_block = top.pop("zero_optimization", None)  # [], 0, false: refused, not "none"
    zero_block = {} if zero_block is None else zero_block
    if not isinstance(zero_block, dict):
        raise ValueError(f"zero_optimization must be an object, got {zero_block!r}")
    if "bfloat16" in top:  # DeepSpeed's other name for the bf16 block
        if "bf16" in top:
            raise ValueError("the config has both bf16 and bfloat16 (DeepSpeed's other name "
                             "for it); keep one")
        top["bf16"] = top.pop("bfloat16")
    fp16, bf16 = top.pop("fp16", None) or {}, top.pop("bf16", None) or {}
    for name, block, like in (("fp16", fp16, '{"enabled": true}'),
                              ("bf16", bf16, '{"enabled": true}'),
                              ("data_types", top.get("data_types"),
                               '{"grad_accum_dtype": "fp32"}')):
        if block is not None and not isinstance(block, dict):
            raise ValueError(f"{name} must be a block such as {like}, got {block!r}")
    # a block whose "enabled" is false runs nothing: accepted whatever it holds
    top = drop_inert(drop_disabled(top, _enabled_or_kept))
    warn_unread_monitor(top.get("monitor_config"))
    warn_no_timers(top.get("wall_clock_breakdown"))
    zero_block = drop_inert_zero(take_cpu_offload(stage3_names(zero_block)))
    if top.get("memory_breakdown") is True:  # DeepSpeed's switch, a block here
        top["memory_breakdown"] = {"enabled": True}
    monitor = {kind: top.pop(kind) for kind in MONITORS if kind in top}  # enabled ones
    top = _drop_auto(top, "", _IGNORED)
    zero_block = _drop_auto(zero_block, "zero_optimization.", _ZERO_IGNORED)
    top["fp16"], top["bf16"] = fp16, bf16
    # DeepSpeed runs stage 0 when the config names none; zero.Config's own
    # default (stage 2) is for zero.initialize(model) without a config
    options["stage"] = zero_block.get("stage", 0)
    if "train_batch_size" in top and "gradient_accumulation_steps" not in top:
        options["gradient_accumulation_steps"] = None  # derived by initialize, as DeepSpeed
    data_types = top.pop("data_types", None) or {}
    fp16 = top.pop("fp16", None) or {}
    bf16 = top.pop("bf16", None) or {}
    options.update(_take(top, "", {
        "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
        "train_batch_size": "train_batch_size",
        "gradient_accumulation_steps": "gradient_accumulation_steps",
        "gradient_clipping": "gradient_clipping",
        "optimizer": "optimizer",
        "scheduler": "scheduler",
        "comms_timeout": "timeout",  # ours: DeepSpeed reads DEEPSPEED_TIMEOUT (minutes) only
        "dataloader_drop_last": "dataloader_drop_last",
        "steps_per_print": "steps_per_print",
        "aio": "aio",
    }, _IGNORED))
    options["steps_per_print"] = _print_interval(options.get("steps_per_print"))
    zero_opts = _take(zero_block, "zero_optimization.", {
        "stage": "stage", "reduce_bucket_size": "reduce_bucket_size",
        "overlap_comm": "overlap_comm", "contiguous_gradients": "contiguous_gradients",
        "offload_optimizer": None, "offload_param": None,
        "stage3_param_persistence_threshold": "stage3_param_persistence_threshold",
        "stage3_prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters": "stage3_max_live_parameters",
        "stage3_max_reuse_distance": "stage3_max_reuse_distance",
        "stage3_model_persistence_threshold": "stage3_model_persistence_threshold",
    }, _ZERO_IGNORED)
    # buffer_count/buffer_size/max_in_cpu size DeepSpeed's pinned buffers;
    # the shard here is read unit by unit through its mapping
    param = _offload_options(zero_block, "offload_param",
                             {"pin_memory", "buffer_count", "buffer_size", "max_in_cpu"})
    # buffer_size/buffer_count size DeepSpeed's pinned I/O buffers (often
    # 1e8 elements); our windows are 3 x chunk_elements per file, so a
    # buffer_size read as chunk_elements would cost GBs of RAM: accepted,
    # ignored, the default chunk kept (docs/offload.md)
    optimizer = _offload_options(zero_block, "offload_optimizer",
                                 {"pin_memory", "buffer_count", "buffer_size", "fast_init",
                                  "ratio", "pipeline_read", "pipeline_write", "super_offload",
                                  "convert_grad_on_cpu", "cpuadam_cores_perc"})
    for key, block in (("offload_param", param), ("offload_optimizer", optimizer)):
        if block is not None:
            options[key] = block
    for key in ("reduce_bucket_size", "stage3_param_persistence_threshold",
                "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                "stage3_max_reuse_distance", "stage3_model_persistence_threshold"):
        if key in zero_opts:  # DeepSpeed configs often write 5e7
            value = _number(zero_opts[key], f"zero_optimization.{key}")
            if value != int(value):
                raise ValueError(f"zero_optimization.{key} must be an integer, got {value!r}")
            zero_opts[key] = int(value)
    options.update(zero_opts)
    if monitor:
        options["monitor"] = monitor
    if "timeout" in options:  # named as the config names it
        options["timeout"] = _seconds(options["timeout"], "comms_timeout")
    options.update(_take(data_types, "data_types.", {"grad_accum_dtype": "grad_accum_dtype",
                                                     "buffer_dtype": "buffer_dtype"}))
    if options.get("buffer_dtype") is not None:
        options["buffer_dtype"] = dtype_name(options["buffer_dtype"], "data_types.buffer_dtype")
    # DeepSpeed 0.19.8 clips at 1.0 when a config names no gradient_clipping
    options.setdefault("gradient_clipping", 1.0)
    enabled = {name: _enabled(block, name) for name, block in (("fp16", fp16), ("bf16", bf16))}
    if enabled["fp16"] and enabled["bf16"]:
        raise ValueError("fp16.enabled and bf16.enabled are both true; choose one")
    # each block's keys are checked whether it is on or not: a typo of
    # "enabled" ("enable": true) left the block off, silently
    bf16_options = _take(bf16, "bf16.", {"enabled": None,
                                         "check_grad_overflow": "check_grad_overflow"},
                         {"immediate_grad_update"})
    scaling = _take(fp16, "fp16.", {
        "enabled": None, "initial_scale_power": "initial_scale_power",
        "loss_scale_window": "loss_scale_window", "hysteresis": "hysteresis",
        "min_loss_scale": "min_loss_scale", "loss_scale": "static_loss_scale",
        "consecutive_hysteresis": "consecutive_hysteresis",
    }, {"auto_cast", "fp16_master_weights_and_grads"})
    if enabled["bf16"]:
        options.update(bf16_options)
        # DeepSpeed 0.19.8 skips a bf16 step with an inf/nan gradient by
        # default at stages 0-2; its stage 3 checks only fp16
        options.setdefault("check_grad_overflow", options["stage"] in (0, 1, 2))
        options["precision"] = "bf16"
    elif enabled["fp16"]:
        # "auto" (HuggingFace's templates) means DeepSpeed's default
        scaling = {k: v for k, v in scaling.items() if v != "auto"}
        options["precision"] = "fp16"
        options["loss_scaling"] = scaling  # Config.from_deepspeed builds the LossScaling
    return options

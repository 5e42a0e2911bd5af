"""What a DeepSpeed config may hold that zero does not take, and how the
refusal says so: a real DeepSpeed key zero does not support (with why and
what to do instead), or no DeepSpeed key at all (a typo, with the nearest
key). Disabled blocks are dropped before anything is read: a block whose
"enabled" is false holds nothing that runs, whatever else it says."""
from __future__ import annotations

import difflib

from zero._warnings import warn_user
from zero.config._values import deepspeed_bool

# DeepSpeed keys (dotted) zero refuses when enabled or set, with the reason
UNSUPPORTED = {
    "comet": "zero writes the tensorboard, csv_monitor and wandb monitors only",
    "amp": "NVIDIA apex AMP is not supported; use bf16 or fp16",
    "activation_checkpointing": "partition_activations, cpu_checkpointing and "
                                "contiguous_memory_optimization are not supported; use "
                                "deepspeed.checkpointing.checkpoint (zero.deepspeed's) or "
                                "torch.utils.checkpoint",
    "checkpoint": "universal checkpoints and node-local storage are not needed: zero's "
                  "checkpoints load at any world size and stage",
    "communication_data_type": "gradients are reduced in the compute dtype (or "
                               "data_types.grad_accum_dtype's)",
    "sparse_gradients": "sparse gradients are not supported: zero reduces dense ones",
    "pipeline": "DeepSpeed's PipelineModule is not read; zero's pipeline parallelism is "
                "torch.distributed.pipelining over zero.initialize(mesh=...) "
                "(zero.parallel.split_gpt/split_llama, pipeline_schedule; docs/parallel.md)",
    "tensor_parallel": "DeepSpeed's AutoTP is not read; zero's tensor parallelism is torch's "
                       "DTensor plans over zero.initialize(mesh=...) (zero.parallel."
                       "parallelize_gpt/parallelize_llama; docs/parallel.md)",
    "compression_training": "not supported",
    "data_efficiency": "not supported",
    "curriculum_learning": "not supported",
    "autotuning": "not supported",
    "elasticity": "not supported",
    "nebula": "not supported",
    "hybrid_engine": "DeepSpeed-Chat's hybrid engine is engine.generate (docs/stage3.md)",
    "compile": "call torch.compile on the model yourself",
    "torch_autocast": "the engine computes in its precision (bf16 or fp16 blocks), without "
                      "autocast",
    "gradient_allreduce_op": "gradients are averaged over the data-parallel ranks",
    "managed_gradient_accumulation": "the engine accumulates in its flat buffers "
                                     "(gradient_accumulation_steps)",
    "graph_harvesting": "CUDA graphs are not captured",
    "weight_quantization": "not supported",
    "eigenvalue": "not supported",
    "progressive_layer_drop": "not supported",
    "expert_parallel": "mixture-of-experts parallelism is not supported; experts train "
                       "data-parallel",
    "use_data_before_expert_parallelism": "mixture-of-experts parallelism is not supported",
    "seq_parallel_communication_data_type": "DeepSpeed's sequence parallelism is not "
                                            "supported",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++'s hierarchical partitioning: use "
                                                 "initialize(mesh=) with a 2-D mesh",
    "zero_optimization.zero_quantized_weights": "ZeRO++'s quantized weights are not supported",
    "zero_optimization.zero_quantized_gradients": "ZeRO++'s quantized gradients are not "
                                                  "supported",
    "zero_optimization.mics_shard_size": "MiCS: use initialize(mesh=) with a 2-D mesh",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS: use initialize(mesh=) "
                                                         "with a 2-D mesh",
    "zero_optimization.zero_quantized_nontrainable_weights": "ZeRO++'s quantized weights "
                                                             "are not supported",
    "zero_optimization.zeropp_loco_param": "LoCo works on ZeRO++'s quantized gradients, "
                                           "which are not supported",
    "zero_optimization.zenflow": "ZenFlow is not supported; offload_optimizer with "
                                 "delayed_update overlaps the host's update with the next "
                                 "step (docs/offload.md)",
    "data_types.keep_in_fp32_modules": "no module is kept in fp32: the whole model computes "
                                       "in the precision's dtype",
    "zero_optimization.leaf_module": "name the leaf modules' classes in zero.initialize("
                                     "stage3_leaf_modules=[...]) or with zero.deepspeed.utils."
                                     "set_z3_leaf_modules(model, [classes])",
}

# the blocks the reader takes apart itself, for the typo hint
BLOCKS = ("fp16", "bf16", "zero_optimization", "data_types", "optimizer", "scheduler")


def drop_disabled(block: dict, enabled) -> dict:
    """block without its sub-blocks whose "enabled" is false (enabled: a
    function reading an "enabled" value as DeepSpeed does)."""
    return {k: v for k, v in block.items()
            if not (isinstance(v, dict) and "enabled" in v and not enabled(v, k))}


# blocks and keys that DeepSpeed configs often carry with every feature
# off: dropped when they are (a feature turned on is refused by name)
_INERT = {
    "activation_checkpointing": lambda b: isinstance(b, dict) and not any(
        b.get(k) for k in ("partition_activations", "cpu_checkpointing",
                           "contiguous_memory_optimization")),
    "checkpoint": lambda b: isinstance(b, dict) and not b.get("load_universal") and
    not b.get("use_node_local_storage"),
    "communication_data_type": lambda v: v is None,
    "sparse_gradients": lambda v: v is False,
    "memory_breakdown": lambda v: v is False,
}


# zero_optimization keys DeepSpeed configs write at their off value
# (DeepSpeed's defaults): dropped then; set to anything else, refused
# by name (UNSUPPORTED)
_ZERO_INERT = {
    "zero_hpz_partition_size": lambda v: v in (0, 1),
    "zero_quantized_weights": lambda v: v is False,
    "zero_quantized_gradients": lambda v: v is False,
    "zero_quantized_nontrainable_weights": lambda v: v is False,
    "mics_shard_size": lambda v: v == -1,
    "mics_hierarchical_params_gather": lambda v: v is False,
    "zeropp_loco_param": lambda v: v is None,
    "zenflow": lambda v: v is None,
    "leaf_module": lambda v: isinstance(v, dict) and not any(v.values()),
}


def drop_inert_zero(block: dict) -> dict:
    """zero_optimization without the ZeRO++, MiCS, ZenFlow and leaf-module
    keys written at their off values (_ZERO_INERT)."""
    return {k: v for k, v in block.items() if not (k in _ZERO_INERT and _ZERO_INERT[k](v))}


def drop_inert(block: dict) -> dict:
    """block without the settings that turn nothing on: an
    activation_checkpointing block with partitioning, CPU checkpointing and
    contiguous memory off (torch's checkpoint needs none of its other
    knobs), a checkpoint block without universal checkpoints or node-local
    storage (tag_validation, parallel_write: zero's checkpoints check and
    write their own way), communication_data_type null, sparse_gradients
    and memory_breakdown false."""
    return {k: v for k, v in block.items() if not (k in _INERT and _INERT[k](v))}


def take_cpu_offload(zero_block: dict) -> dict:
    """zero_optimization.cpu_offload, DeepSpeed's old switch for optimizer
    offload, read as DeepSpeed 0.19.8 reads it (offload_optimizer
    {"device": "cpu"} when true), with its deprecation warning; its
    params/pin_memory companions likewise."""
    block = dict(zero_block)
    old = block.pop("cpu_offload", None)
    params = block.pop("cpu_offload_param", None)
    block.pop("cpu_offload_use_pin_memory", None)
    if old is not None or params is not None:
        warn_user("zero_optimization.cpu_offload is deprecated (in DeepSpeed too): write "
                  '"offload_optimizer": {"device": "cpu"} (and "offload_param" for '
                  "cpu_offload_param)", DeprecationWarning)
    # "false" as DeepSpeed reads it, not by Python's truth (a non-empty string)
    old = deepspeed_bool(old, "zero_optimization.cpu_offload") if old is not None else None
    params = deepspeed_bool(params, "zero_optimization.cpu_offload_param") \
        if params is not None else None
    if old and "offload_optimizer" not in block:
        block["offload_optimizer"] = {"device": "cpu"}
    if params and "offload_param" not in block:
        block["offload_param"] = {"device": "cpu"}
    return block


# DeepSpeed 0.19.8's zero_optimization takes each stage-3 knob under its
# field name as well as the stage3_ one it documents (its config model
# populates by either): axolotl's shipped configs write max_live_parameters
_STAGE3_FIELDS = ("prefetch_bucket_size", "param_persistence_threshold",
                  "model_persistence_threshold", "max_live_parameters", "max_reuse_distance",
                  "gather_16bit_weights_on_model_save", "module_granularity_threshold",
                  "use_all_reduce_for_fetch_params", "allgather_sequential")


def stage3_names(zero_block: dict) -> dict:
    """zero_block with DeepSpeed's field names of the stage-3 knobs
    (max_live_parameters) under the names it documents
    (stage3_max_live_parameters); both given with different values is
    refused, as neither would be the one read."""
    block = dict(zero_block)
    for field in _STAGE3_FIELDS:
        if field in block:
            value, alias = block.pop(field), "stage3_" + field
            if alias in block and block[alias] != value:
                raise ValueError(f"zero_optimization.{field} and zero_optimization.{alias} are "
                                 f"the same setting, given two values ({value!r} and "
                                 f"{block[alias]!r}); write one")
            block[alias] = value
    return block


def warn_unread_monitor(block):
    """A "monitor_config" block that enables a monitor: DeepSpeed reads the
    monitors at the top level only ("csv_monitor", "tensorboard", "wandb",
    "comet"), so nothing logs from it there or here; said once."""
    if not isinstance(block, dict):
        return
    asked = [k for k, v in block.items() if isinstance(v, dict) and v.get("enabled") is True]
    if asked:
        warn_user(f"monitor_config.{asked[0]} is enabled, but \"monitor_config\" is not a "
                  "key DeepSpeed reads (it ignores it, and so does zero): write "
                  f"\"{asked[0]}\" at the top level of the config to log", UserWarning)


def warn_no_timers(value):
    """wall_clock_breakdown on: DeepSpeed prints its forward, backward and
    step times and adds them to the monitor; zero keeps no such timers, so
    it says so once rather than print nothing without a word."""
    if value is True:
        warn_user("wall_clock_breakdown is on, but zero keeps no wall-clock timers: nothing "
                  "is printed or logged for it (time the loop yourself; the flops_profiler "
                  "block times one step, engine.comm_summary() counts the collectives)",
                  UserWarning)


def refusal(keys: list, known: list) -> ValueError:
    """The error for config keys zero does not take, each said to be a
    DeepSpeed key zero does not support (why, what instead) or not a
    DeepSpeed key at all (the nearest one it could be a typo of)."""
    parts = []
    for key in keys:
        if key in UNSUPPORTED:
            parts.append(f"{key}: a DeepSpeed key zero does not support ({UNSUPPORTED[key]})")
            continue
        candidates = [*known, *UNSUPPORTED, *BLOCKS]
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.75)
        hint = f" of {close[0]!r}" if close else ""
        parts.append(f"{key}: not a DeepSpeed key (a typo{hint}?)")
    return ValueError("DeepSpeed config key(s) zero does not take: " + "; ".join(parts) +
                      ". docs/deepspeed.md lists the keys zero reads, ignores and refuses")


MONITORS = ("tensorboard", "csv_monitor", "wandb", "flops_profiler", "comms_logger",
            "memory_breakdown")


def check_monitor(monitor, enabled) -> dict:
    """The monitor setting as a dict of enabled blocks, or a ValueError.
    enabled(block, name): a block's "enabled" read as DeepSpeed reads it
    (JSON true or false, or a word such as "true"), as for every block."""
    if monitor is None:
        return {}
    if not isinstance(monitor, dict):
        raise ValueError(f"monitor must be a dict of DeepSpeed monitor blocks ({', '.join(MONITORS)}),"
                         f" got {monitor!r}")
    out = {}
    for kind, block in monitor.items():
        if kind not in MONITORS:
            raise ValueError(f"monitor: {kind!r} is not a monitor zero writes; it writes "
                             f"{', '.join(MONITORS)}")
        if not isinstance(block, dict):
            raise ValueError(f"monitor.{kind} must be an object, got {block!r}")
        known = {"wandb": {"enabled", "group", "team", "project"},
                 "flops_profiler": {"enabled", "profile_step", "module_depth", "top_modules",
                                    "detailed", "output_file", "recompute_fwd_factor"},
                 "comms_logger": {"enabled", "verbose", "prof_all", "prof_ops", "debug"},
                 "memory_breakdown": {"enabled"},
                 }.get(kind, {"enabled", "output_path", "job_name"})
        unknown = set(block) - known
        if unknown:
            raise ValueError(f"{kind}: unknown key(s) {sorted(unknown)}; it takes "
                             f"{sorted(known)}")
        if enabled(block, kind):
            out[kind] = _monitor_values(kind, dict(block))
    return out


_MONITOR_FLAGS = ("detailed", "verbose", "prof_all", "debug")
_MONITOR_TEXTS = ("output_path", "job_name", "group", "team", "project", "output_file")


def _monitor_values(kind: str, block: dict) -> dict:
    """An enabled monitor block with its values checked by name: a path of
    another type raised from posixpath, prof_ops "reduce" became the set of
    its letters (nothing logged), profile_step 0 never profiled, and
    "false" in a flag read as true."""
    for key in _MONITOR_FLAGS:
        if key in block:
            block[key] = deepspeed_bool(block[key], f"{kind}.{key}")
    for key in _MONITOR_TEXTS:
        if block.get(key) is not None and not isinstance(block[key], str):
            raise ValueError(f"{kind}.{key} must be a string, got {block[key]!r}")
    ops = block.get("prof_ops")
    if ops is not None and (not isinstance(ops, (list, tuple)) or
                            not all(isinstance(op, str) for op in ops)):
        raise ValueError(f"{kind}.prof_ops must be a list of operation names, such as "
                         f"[\"all_reduce\"], got {ops!r}")
    for key, low in (("profile_step", 1), ("top_modules", 1), ("module_depth", -1)):
        value = block.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or
                                  value < low):
            raise ValueError(f"{kind}.{key} must be an integer >= {low}, got {value!r}")
    return block


# DeepSpeed's aio block: what zero's disk engine takes, and what it accepts
# without effect (its engine has one submission path and its own threads)
AIO_TAKEN = ("block_size", "queue_depth")
AIO_IGNORED = ("thread_count", "intra_op_parallelism", "single_submit", "overlap_events")


def _check_aio_limit(key, value):
    """The disk engine's own limits (zero._C.Aio checks them again), named
    here under the config's key: raised from the engine's construction, a
    refusal lost the `aio.` and came after the model was laid out."""
    import zero._C as _C
    if key == "block_size" and (value % _C.AIO_ALIGN or value > _C.AIO_MAX_BLOCK):
        raise ValueError(f"aio.block_size must be a multiple of {_C.AIO_ALIGN} bytes up to "
                         f"{_C.AIO_MAX_BLOCK:,}, got {value!r}")
    if key == "queue_depth" and value > _C.AIO_MAX_QUEUE_DEPTH:
        raise ValueError(f"aio.queue_depth must be at most {_C.AIO_MAX_QUEUE_DEPTH}, got "
                         f"{value!r}")


def check_aio(aio) -> dict | None:
    """The aio setting as {"block_size", "queue_depth"} (either may be
    absent), or None; a ValueError naming the key for anything else."""
    if aio is None:
        return None
    if not isinstance(aio, dict):
        raise ValueError(f"aio must be an object, got {aio!r}")
    out = {}
    for key, value in aio.items():
        if key in AIO_TAKEN:
            # (inf and NaN raised from int(); above 2^31 from the C engine)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 1 <= value < 2**31 or value != int(value):
                raise ValueError(f"aio.{key} must be an integer from 1 to 2^31 - 1, got "
                                 f"{value!r}")
            out[key] = int(value)
            _check_aio_limit(key, out[key])
        elif key == "use_gds":
            if value:
                raise ValueError("aio.use_gds: GPUDirect Storage is not supported; set it "
                                 "to false (zero reads and writes through host memory)")
        elif key not in AIO_IGNORED:
            raise refusal([f"aio.{key}"], [f"aio.{k}" for k in (*AIO_TAKEN, *AIO_IGNORED,
                                                                  "use_gds")])
    return out or None

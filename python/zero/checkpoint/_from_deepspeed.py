"""convert_deepspeed: a DeepSpeed checkpoint (ZeRO stage 0-3, any
data-parallel world size, fp32/bf16/fp16) written as a zero checkpoint
that engine.load_checkpoint resumes at any world size and stage: fp32
masters, optimizer states, step counts, the LR scheduler, the fp16 loss
scaler, global_steps and the plain part of client_state.

DeepSpeed's files are pickles: they are read as [Note: reading
DeepSpeed's pickles] says, and only when the caller says it trusts them
(trust_pickle=True, the command's --trust-pickle). The layouts read are in
[Note: DeepSpeed's partitions]. The output is zero's usual checkpoint
([Note: checkpoint layout]): one meta and one shard file, all plain.
"""
from __future__ import annotations

import os
import zlib

import torch

from zero._warnings import warn_user
from zero._progress import bar
from zero._version import __version__
from zero.checkpoint._deepspeed_files import (StandIn, load_pickle, model_states_files,
                                              optim_states_files, tag_directory)
from zero.checkpoint._deepspeed_layout import (fail, loss_scaler_state, module_entries,
                                               read_stage_0, read_stage_1_2, read_stage_3,
                                               stage_3_frozen)
from zero.checkpoint._format import (FORMAT, META_FILE, REPLICATED_GROUP, VERSION, check_tag,
                                     shard_file, staging_directory)
from zero.checkpoint._plain_values import check_plain
from zero.checkpoint._writes import (discard_replaced, discard_staging, prepare_staging, publish,
                                     write_file, write_latest)
from zero.step._registry import SPECS

TRUST_PICKLE_WHY = (
    "DeepSpeed's checkpoint files are Python pickles, and a pickle can be made to run code "
    "when it is read. The converter reads them with torch's weights_only unpickler and inert "
    "stand-ins for DeepSpeed's classes, so no code they name is run, but the files still go "
    "through a general-purpose unpickler. Pass trust_pickle=True (--trust-pickle) if they "
    "come from your own DeepSpeed run; zero's own checkpoints never need this")

# what DeepSpeed itself puts in model_states; every other key is the user's client_state
DEEPSPEED_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info"}
# param-group keys zero's optimizers read; DeepSpeed's own (bias_correction, its
# group "step", adam_w_mode) are checked or dropped
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening",
              "nesterov", "lr_decay", "initial_accumulator_value")


def convert_deepspeed(ds_dir, out_dir, *, tag=None, out_tag=None, trust_pickle=False) -> str:
    """Write the DeepSpeed checkpoint in `ds_dir` (its `latest` tag, or
    `tag`; or `ds_dir` may be the tag directory itself) into `out_dir` as a
    zero checkpoint under `out_tag` (default: DeepSpeed's tag), and name it
    in `out_dir`/latest. Returns the written tag directory."""
    if trust_pickle is not True:  # a consent, not a truth value ("no" is truthy)
        if trust_pickle is not False:
            raise TypeError(f"trust_pickle must be True or False, got {trust_pickle!r}")
        raise PermissionError(TRUST_PICKLE_WHY)
    path = tag_directory(os.fspath(ds_dir), tag)
    out_tag = check_tag(out_tag or os.path.basename(os.path.normpath(path)), saving=True)
    _check_output(os.fspath(out_dir), path)
    converted = _read(path)
    meta, shard = _zero_files(converted, path)
    return _write(os.fspath(out_dir), out_tag, meta, shard, path)


def _stage_of(optims, path) -> int:
    if not optims:
        return 0
    stage = optims[0].get("zero_stage")
    if isinstance(stage, StandIn):  # DeepSpeed's ZeroStageEnum(value)
        stage = stage.args[0] if stage.args else stage.__dict__.get("_value_")
    if stage not in (1, 2, 3):
        raise fail(path, f"its optimizer states name ZeRO stage {stage!r}")
    return stage


def _read(path) -> dict:
    model_files, optim_files = model_states_files(path), optim_states_files(path)
    with bar("reading the DeepSpeed checkpoint", total=len(model_files) + len(optim_files),
             unit="file") as progress:
        model_states, optims = [], []
        for f in model_files:
            model_states.append(load_pickle(f))
            progress.update(1)
        for f in optim_files:
            optims.append(load_pickle(f)["optimizer_state_dict"])
            progress.update(1)
    ms = model_states[0]
    stage = _stage_of(optims, path)
    world = int(ms.get("dp_world_size", 1))
    if int(ms.get("mp_world_size", 1)) != 1:
        raise fail(path, f"it was saved with model parallelism (mp_world_size "
                   f"{ms['mp_world_size']}); the converter reads data-parallel ZeRO only")
    if stage > 0 and len(optims) != world:
        raise fail(path, f"it has {len(optims)} optimizer-states files for a data-parallel "
                   f"world of {world}")
    entries, module_params, buffers = module_entries(ms, path)
    if stage == 0:
        values, states, groups = read_stage_0(ms, module_params, path)
        shapes = {name: tuple(ms["module"][name].shape) for name in module_params}
        frozen = {}
    else:
        reader = read_stage_3 if stage == 3 else read_stage_1_2
        values, states, groups = reader(model_states if stage == 3 else ms, optims, path)
        shapes = {name: tuple(shape) for group in ms["param_shapes"]
                  for name, shape in group.items()}
        frozen_shapes = {name: tuple(s) for name, s in (ms.get("frozen_param_shapes") or {})
                         .items()}
        frozen = stage_3_frozen(model_states, frozen_shapes) if stage == 3 else \
            {name: ms["module"][name].reshape(-1).float().clone() for name in frozen_shapes}
        shapes.update(frozen_shapes)
    missing = [name for name in module_params if name not in shapes]
    if missing:
        raise fail(path, f"module parameters {missing[:3]} are in neither its param_shapes "
                   "nor its frozen_param_shapes")
    values.update(frozen)
    return {"stage": stage, "world": world, "model_states": ms, "entries": entries,
            "buffers": buffers, "shapes": {name: shapes[name] for name in module_params},
            "frozen": set(frozen), "values": values, "states": states, "groups": groups,
            "optimizer": _optimizer_kind(ms, states, path),
            # stages 1-3 keep it with the optimizer's states, stage 0 in its optimizer
            "scaler": optims[0].get("loss_scaler") if optims else
            (ms.get("optimizer") or {}).get("loss_scaler")}


def _optimizer_kind(ms, states, path) -> str:
    """zero's optimizer spec for the states DeepSpeed kept, checked against
    the config's optimizer type when it names one."""
    keys = set().union(*(set(s) for s in states.values()))
    if {"exp_avg", "exp_avg_sq"} <= keys:
        kind = "adam"
    elif keys == {"exp_avg"}:
        kind = "lion"
    elif keys == {"sum"}:
        kind = "adagrad"
    elif keys <= {"momentum_buffer"}:
        kind = "sgd"
    else:
        raise fail(path, f"its optimizer keeps the states {sorted(keys)}, which no optimizer "
                   f"zero runs keeps ({', '.join(sorted(SPECS))})")
    named = ((ms.get("ds_config") or {}).get("optimizer") or {}).get("type")
    if isinstance(named, str):
        spec = next((s for s in SPECS.values() if named.lower() in s.deepspeed_types), None)
        if spec is None or spec.name != kind:
            raise fail(path, f"its config's optimizer {named!r} is not one zero runs with "
                       f"these states ({sorted(keys)})")
    return kind


def _hyper(group: dict, path, index: int) -> dict:
    if group.get("bias_correction") is False:
        raise fail(path, f"param group {index} ran Adam without bias correction, which zero's "
                   "Adam always applies")
    return {key: (list(v) if isinstance(v, tuple) else v)
            for key, v in group.items() if key in HYPER_KEYS}


def _accumulation(ds_config: dict, world: int) -> int:
    if "gradient_accumulation_steps" in ds_config:
        return int(ds_config["gradient_accumulation_steps"])
    micro, batch = ds_config.get("train_micro_batch_size_per_gpu"), \
        ds_config.get("train_batch_size")
    return int(batch) // (int(micro) * world) if micro and batch else 1


def _plain_or_dropped(value, where):
    try:
        check_plain(value, where)
        return value, None
    except TypeError as why:
        return None, str(why)


def _save_id_of(path) -> int:
    """The converted checkpoint's save id, from what it was converted from
    (its tag, and each DeepSpeed file's name, size and first and last MiB):
    copies of one DeepSpeed checkpoint converted on each machine (node-local
    disks) load together, as load_checkpoint compares the ranks' save ids;
    a random id refused them."""
    h = zlib.crc32(os.path.basename(os.path.normpath(path)).encode())
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        size = os.path.getsize(file)
        h = zlib.crc32(f"{name}:{size}".encode(), h)
        with open(file, "rb") as f:
            h = zlib.crc32(f.read(1 << 20), h)
            f.seek(max(0, size - (1 << 20)))
            h = zlib.crc32(f.read(1 << 20), h)
    return h


def _zero_files(c, path) -> tuple:
    ms, ds_config = c["model_states"], c["model_states"].get("ds_config") or {}
    save_id = _save_id_of(path)
    spec = SPECS[c["optimizer"]]
    params = {name: {"shape": list(shape), "numel": int(torch.Size(shape).numel()),
                     "trainable": name not in c["frozen"]} for name, shape in c["shapes"].items()}
    skipped = int(ms.get("skipped_steps", 0))
    groups, shard_groups = [], []
    for gi, group in enumerate(c["groups"]):
        hyper = _hyper(group["hyper"], path, gi)
        step = group["step"]
        if spec.name == "sgd" and not step and any("momentum_buffer" in c["states"].get(n, {})
                                                   for n in group["names"]):
            step = int(ms.get("global_steps", 0)) - skipped  # torch's SGD keeps no step
        names = [n for n in group["names"] if params[n]["numel"]]
        keys = sorted(set().union(*(set(c["states"].get(n, {})) for n in names)))
        groups.append({"param_names": list(group["names"]), "hyper": hyper, "step": step,
                       "states": keys})
        shard_groups.append(_shard_group(gi, names, c, keys))
    frozen = [n for n in c["shapes"] if n in c["frozen"] and params[n]["numel"]]
    if frozen:
        shard_groups.append(_shard_group(REPLICATED_GROUP, frozen, c, []))
    client_state, dropped = {}, []
    for key in ms:
        if key not in DEEPSPEED_KEYS:
            value, why = _plain_or_dropped(ms[key], f"client_state[{key!r}]")
            if why:
                dropped.append(why)
            else:
                client_state[key] = value
    scheduler, why = _plain_or_dropped(ms.get("lr_scheduler"), "lr_scheduler")
    dropped += [why] if why else []
    for why in dropped:
        warn_user(f"not converted (a zero checkpoint keeps plain values only): {why}")
    fp16 = bool((ds_config.get("fp16") or {}).get("enabled"))
    bf16 = bool((ds_config.get("bf16") or {}).get("enabled"))
    scaler = loss_scaler_state(c["scaler"]) if fp16 else None
    global_steps = int(ms.get("global_steps", 0))
    meta = {"format": FORMAT, "version": VERSION, "zero_version": __version__,
            "world_size": 1, "stage": c["stage"], "tensor_parallel": 1, "pipeline_stages": 1,
            "precision": "fp16" if fp16 else "bf16" if bf16 else "fp32",
            "optimizer": spec.name, "optimizer_class": _class_name(ds_config, spec),
            "params": params, "state_dict": [list(e) for e in c["entries"]],
            "buffers": {k: t.detach().clone() for k, t in c["buffers"].items()}, "groups": groups,
            "engine": {"micro_steps": global_steps * _accumulation(ds_config, c["world"]),
                       "global_steps": global_steps, "skipped_steps": skipped},
            "loss_scaler": scaler, "lr_scheduler": scheduler, "client_state": client_state,
            "shards": [shard_file(0)], "save_id": save_id,
            "converted_from": {"deepspeed_version": str(ms.get("ds_version", "")),
                               "zero_stage": c["stage"], "world_size": c["world"]}}
    shard = {"format": FORMAT, "version": VERSION, "rank": 0, "save_id": save_id,
             "groups": [g for g in shard_groups if g is not None]}
    return meta, shard


def _class_name(ds_config, spec) -> str:
    """What the meta says the optimizer was (for messages only)."""
    named = (ds_config.get("optimizer") or {}).get("type")
    if isinstance(named, str):
        return f"DeepSpeed {named}"
    return spec.torch_classes[0].__qualname__ if spec.torch_classes else spec.name


def _shard_group(index, names, c, keys):
    """One group of the shard file: its parameters end to end."""
    if not names:
        return None
    pieces, offset = [], 0
    for name in names:
        n = c["values"][name].numel()
        pieces.append((name, 0, n, offset))
        offset += n
    # detached: DeepSpeed pickled its module's Parameters, which would keep requires_grad
    tensors = {"value": torch.cat([c["values"][n] for n in names]).detach()}
    for key in keys:
        tensors[key] = torch.cat([c["states"][n][key] for n in names]).detach()
    return {"index": index, "tensors": tensors, "pieces": pieces}


def _check_output(out_dir, source):
    """The output must leave the DeepSpeed checkpoint as it was: not in its
    tag directory (nor the tag directory itself), and not its save
    directory, whose `latest` file the zero checkpoint's would replace."""
    out, tag_dir = os.path.realpath(out_dir), os.path.realpath(source)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"output {out_dir!r} is a file, not a directory")
    if os.path.commonpath([out, tag_dir]) == tag_dir:
        raise ValueError(f"output {out_dir!r} is inside the DeepSpeed checkpoint it reads "
                         f"({source!r}); write it outside that tag directory")
    if out == os.path.dirname(tag_dir):
        raise ValueError(f"output {out_dir!r} is the DeepSpeed checkpoint's own directory: "
                         "its 'latest' file would name the zero checkpoint; write it into "
                         "another directory")


def _write(out_dir, out_tag, meta, shard, source) -> str:
    lock = prepare_staging(out_dir, out_tag)
    try:
        staging = staging_directory(out_dir, out_tag)
        write_file(shard, os.path.join(staging, shard_file(0)))
        write_file(meta, os.path.join(staging, META_FILE))
        publish(out_dir, out_tag)
        write_latest(out_dir, out_tag)
        discard_replaced(out_dir, out_tag)
    except BaseException:
        discard_staging(out_dir, out_tag)
        raise
    finally:
        lock.release()
    return os.path.join(out_dir, out_tag)

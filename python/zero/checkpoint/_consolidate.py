"""consolidate(): a checkpoint of engine.save_checkpoint read back as plain
torch state dicts, with no engine and no process group."""
from __future__ import annotations

import torch

from zero.config._values import require_bool
from zero.checkpoint._format import CheckpointReader, resolve_tag
from zero.step._registry import SPECS


def _optimizer_state_dict(reader) -> dict:
    """torch.optim's layout: params numbered through the groups in order;
    a state entry for every trainable parameter."""
    meta = reader.meta
    spec = SPECS[meta["optimizer"]]  # the reader checked the name
    state, groups, index = {}, [], 0
    for saved in meta["groups"]:
        numbers = []
        for name in saved["param_names"]:
            if meta["params"][name]["trainable"]:
                entry = {"step": torch.tensor(float(saved["step"]))} \
                    if spec.torch_keeps_step else {}
                for key in saved["states"]:
                    # a lazy state never started (SGD's buffer before a
                    # step with momentum: counts_as_step) is none in torch
                    if not (key in spec.lazy_states and saved["step"] == 0):
                        entry[key] = reader.read(name, key)
                state[index] = entry
            numbers.append(index)
            index += 1
        groups.append({**saved["hyper"], "params": numbers})
    return {"state": state, "param_groups": groups}


def consolidate(save_dir, tag=None, with_optimizer: bool = True) -> dict:
    """{"model": the fp32 state dict (every key, tied weights under each
    name), "optimizer": torch.optim's state dict for the saved optimizer
    (None if with_optimizer is False), "lr_scheduler", "client_state",
    "global_steps", "meta": what else the checkpoint records}."""
    require_bool(with_optimizer, "with_optimizer")
    return read_checkpoint(resolve_tag(save_dir, tag), with_optimizer)


def read_checkpoint(path, with_optimizer) -> dict:
    reader = CheckpointReader(path)
    meta = reader.meta
    values = {name: reader.read(name) for name in meta["params"]}
    model = {}
    for key, kind, name in meta["state_dict"]:
        if kind == "param":
            model[key] = values[name]
        elif kind == "extra_state":  # as the module gave it ([Note: extra state])
            model[key] = meta["extra_states"][key]
        else:  # floating buffers in fp32 too, as engine.full_state_dict() gives them
            buffer = meta["buffers"][key]  # (a float64 one as it is)
            model[key] = buffer.float() if buffer.is_floating_point() and \
                buffer.element_size() < 4 else buffer
    optimizer = _optimizer_state_dict(reader) if with_optimizer else None
    rest = {k: v for k, v in meta.items() if k not in ("buffers", "client_state",
                                                        "lr_scheduler")}
    return {"model": model, "optimizer": optimizer, "lr_scheduler": meta["lr_scheduler"],
            "client_state": meta["client_state"],
            "global_steps": meta["engine"]["global_steps"], "meta": rest}



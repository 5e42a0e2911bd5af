"""A DeepSpeed checkpoint (ZeRO stage 0-3, any data-parallel world size)
read into whole parameters: each trainable parameter's fp32 master and
optimizer states, the frozen ones' values, the buffers, the optimizer's
param groups and step counts.

[Note: DeepSpeed's partitions] How DeepSpeed 0.19.8 lays out what it
saves (read from its files; tests/data/deepspeed_checkpoints):
- Stages 1-2: for each param group, the parameters in `param_shapes`
  order form one flat vector, cut into one stretch per rank.
  `single_partition_of_fp32_groups[g]` is rank R's stretch (the last
  rank's without its alignment padding), so the ranks' stretches laid
  end to end are the group's parameters, one after another. The base
  optimizer holds one flat tensor per group; its states are stretches
  of the same length (padding included, cut here).
- Stage 3: every parameter is cut on its own into `world` stretches of
  ceil(numel / world) elements (the last padded). Rank R's
  `fp32_flat_groups[j]` lays its stretch of each parameter of sub-group j
  end to end, in `param_shapes` order; the optimizer's param group g
  lists its sub-groups j.
- Stage 0: the module's state dict is the weights; the optimizer's state
  dict is torch's (one state per parameter) or, in bf16/fp16, holds one
  fp32 flat vector per group (`fp32_groups_flat`). Neither names the
  parameters: they are taken in the module's order, which only a single
  param group covering every parameter makes certain.
"""
from __future__ import annotations

import math

import torch

from zero.checkpoint._deepspeed_files import StandIn


def fail(path, why) -> ValueError:
    return ValueError(f"DeepSpeed checkpoint {path!r}: {why}")


def _int(step) -> int:
    return int(step.item()) if isinstance(step, torch.Tensor) else int(step)


def group_step(states: list) -> int:
    """A group's update count: its states' "step" (DeepSpeed keeps one per
    flat tensor; torch's optimizers one per parameter: the largest, as a
    parameter added late or without gradients has counted fewer)."""
    return max((_int(s["step"]) for s in states if "step" in s), default=0)


def state_tensors(state: dict) -> dict:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"}


def module_entries(module_states, path):
    """The state dict's entries, ties resolved: the first key of a tensor
    is its parameter's name (DeepSpeed's `shared_params` maps the others,
    at stages 1-3; at stage 0 tied tensors share their storage)."""
    module = module_states["module"]
    buffer_names = set(module_states.get("buffer_names") or [])
    shared = dict(module_states.get("shared_params") or {})
    entries, params, seen = [], [], {}
    for key, t in module.items():
        if key in buffer_names:
            entries.append((key, "buffer", None))
        elif key in shared:
            entries.append((key, "param", shared[key]))
        else:
            where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) \
                if t.numel() else None
            if where in seen:
                entries.append((key, "param", seen[where]))
                continue
            if where is not None:
                seen[where] = key
            entries.append((key, "param", key))
            params.append(key)
    buffers = {key: module[key] for key, kind, _n in entries if kind == "buffer"}
    for key, kind, name in entries:
        if kind == "param" and name not in params:
            raise fail(path, f"state-dict key {key!r} is tied to {name!r}, which it does not hold")
    return entries, params, buffers


def _walk(flat: torch.Tensor, shapes: dict, path, what: str) -> dict:
    """Stages 1-2: the group's parameters one after another in `flat`."""
    out, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].float().clone()
        offset += n
    if offset != flat.numel():
        raise fail(path, f"{what} holds {flat.numel()} elements where its parameters have "
                   f"{offset}: a layout this converter does not know")
    return out


def read_stage_1_2(model_states, optims, path) -> tuple:
    """values, states, groups of a stage-1/2 checkpoint."""
    shapes_of_groups = model_states["param_shapes"]
    values, states, groups = {}, {}, []
    for g, shapes in enumerate(shapes_of_groups):
        parts, state_parts, step_states, hyper = [], {}, [], None
        for rank, osd in enumerate(optims):
            if any(any(p) for p in osd.get("param_alignment_paddings", [[]])[g:g + 1]):
                raise fail(path, "its parameters are aligned with padding between them "
                           "(param_alignment_paddings), which this converter does not read")
            base = osd["base_optimizer_state"]
            if not isinstance(base, dict) or "param_groups" not in base:
                raise fail(path, "it is an elastic checkpoint (base_optimizer_state is a "
                           "list); save it with elastic_checkpoint off")
            part = osd["single_partition_of_fp32_groups"][g]
            parts.append(part)
            index = base["param_groups"][g]["params"][0]
            state = base["state"].get(index, {})
            step_states.append(state)
            for key, t in state_tensors(state).items():
                state_parts.setdefault(key, []).append(t.reshape(-1)[:part.numel()])
            hyper = base["param_groups"][g]
        values.update(_walk(torch.cat(parts), shapes, path, f"param group {g}'s master"))
        for key, pieces in state_parts.items():
            for name, t in _walk(torch.cat(pieces), shapes, path,
                                 f"param group {g}'s {key!r}").items():
                states.setdefault(name, {})[key] = t
        groups.append({"names": list(shapes), "hyper": hyper, "step": group_step(step_states)})
    return values, states, groups


def _unstripe(rank_flats: list, shapes: dict, world: int, path, what: str) -> dict:
    """Stage 3: each parameter's ceil(numel / world) stretch on each rank."""
    out, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        part = -(-n // world)
        out[name] = torch.cat([flat[offset:offset + part] for flat in rank_flats])[:n] \
            .float().clone()
        offset += part
    if any(flat.numel() != offset for flat in rank_flats):
        raise fail(path, f"{what} holds {rank_flats[0].numel()} elements on a rank where its "
                   f"parameters' stretches have {offset}: a layout this converter does not know")
    return out


def read_stage_3(model_states_of_ranks, optims, path) -> tuple:
    world = len(optims)
    shapes_of_groups = model_states_of_ranks[0]["param_shapes"]
    values, states, groups = {}, {}, []
    inner = [osd["optimizer_state_dict"] for osd in optims]
    for g, shapes in enumerate(shapes_of_groups):
        sub_groups = inner[0]["param_groups"][g]["params"]
        flats = [torch.cat([osd["fp32_flat_groups"][j].reshape(-1) for j in sub_groups])
                 for osd in optims]
        values.update(_unstripe(flats, shapes, world, path, f"param group {g}'s master"))
        keys = set().union(*(state_tensors(inner[0]["state"].get(j, {})) for j in sub_groups))
        for key in keys:
            flats = [torch.cat([sd["state"][j][key].reshape(-1) for j in sub_groups])
                     for sd in inner]
            for name, t in _unstripe(flats, shapes, world, path,
                                     f"param group {g}'s {key!r}").items():
                states.setdefault(name, {})[key] = t
        steps = [sd["state"].get(j, {}) for sd in inner for j in sub_groups]
        groups.append({"names": list(shapes), "hyper": inner[0]["param_groups"][g],
                       "step": group_step(steps)})
    return values, states, groups


def stage_3_frozen(model_states_of_ranks, shapes: dict) -> dict:
    """Stage 3's frozen parameters: each rank's stretch in frozen_param_fragments."""
    out = {}
    for name, shape in shapes.items():
        pieces = [ms["frozen_param_fragments"][name].reshape(-1) for ms in model_states_of_ranks]
        out[name] = torch.cat(pieces)[:math.prod(shape)].float().clone()
    return out


def read_stage_0(model_states, params, path) -> tuple:
    """values, states, groups of a checkpoint without ZeRO."""
    opt = model_states.get("optimizer")
    if not isinstance(opt, dict):
        raise fail(path, "it holds no optimizer states (saved without an optimizer?)")
    flats = opt.get("fp32_groups_flat")
    inner = opt.get("optimizer_state_dict", opt)
    param_groups = inner.get("param_groups") or []
    if len(param_groups) != 1:
        raise fail(path, f"a stage-0 checkpoint with {len(param_groups)} param groups does not "
                   "say which parameter each optimizer state belongs to; the converter reads "
                   "stage 0 with one param group only")
    module = model_states["module"]
    shapes = {name: tuple(module[name].shape) for name in params}
    if flats is not None:  # bf16/fp16: one fp32 flat vector
        index = param_groups[0]["params"][0]
        values = _walk(flats[0].reshape(-1), shapes, path, "the fp32 master")
        state = inner["state"].get(index, {})
        per_key = {key: _walk(t.reshape(-1), shapes, path, f"the {key!r} state")
                   for key, t in state_tensors(state).items()}
        step_states = [state]
    else:  # torch's state dict: one state per parameter, in the module's order
        indices = param_groups[0]["params"]
        if len(indices) != len(params):
            raise fail(path, f"its optimizer holds {len(indices)} parameters and the module "
                       f"{len(params)}: with frozen parameters a stage-0 checkpoint does not "
                       "say which are which")
        values = {name: module[name].reshape(-1).float().clone() for name in params}
        per_key, step_states = {}, []
        for name, index in zip(params, indices):
            state = inner["state"].get(index, {})
            step_states.append(state)
            for key, t in state_tensors(state).items():
                if t.numel() != values[name].numel():
                    raise fail(path, f"optimizer state {index} has {t.numel()} elements, "
                               f"parameter {name!r} {values[name].numel()}: the optimizer's "
                               "parameters are not in the module's order")
                per_key.setdefault(key, {})[name] = t.reshape(-1).float().clone()
    states = {}
    for key, by_name in per_key.items():
        for name, t in by_name.items():
            states.setdefault(name, {})[key] = t
    return values, states, [{"names": list(params), "hyper": param_groups[0],
                             "step": group_step(step_states)}]


def loss_scaler_state(scaler) -> dict | None:
    """DeepSpeed's LossScaler / DynamicLossScaler as zero's scaler state:
    good_steps is the steps since the last overflow, which is how both
    count towards the next doubling (step/_loss_scaler.py)."""
    if not isinstance(scaler, StandIn):
        return None
    attrs = scaler.__dict__
    if "cur_scale" not in attrs:
        return None
    state = {"scale": float(attrs["cur_scale"]), "hysteresis_left": 1, "good_steps": 0}
    if attrs.get("dynamic"):
        state["hysteresis_left"] = int(attrs.get("cur_hysteresis", 1))
        state["good_steps"] = max(0, int(attrs.get("cur_iter", 0))
                                  - int(attrs.get("last_overflow_iter", -1)) - 1)
    return state

"""A pipeline-parallel checkpoint's one meta: each stage's part (its
parameters, state dict entries, buffers and optimizer groups, given by the
stage's first data- and tensor-parallel rank) merged into the whole
model's, as one optimizer over the whole model would hold it.

[Note: the whole model's order] A merged group lists its parameters in
the model's order: by pipeline stage (the stage's global index, so a rank
holding stages 0 and 2 of an interleaved split gives them their places
apart), then by their order inside the stage. Merged rank by rank, a rank
of two stages put blocks 0, 2, 1, 3 in that order, and consolidate()
numbered the optimizer states so: a plain torch optimizer over the whole
model loaded block 1's momentum into block 2 (shapes alike: no error)."""
from __future__ import annotations

from zero.checkpoint._engine_parts import checkpoint_name, holds_a_part
from zero.parallel._virtual_stages import is_chunked
from zero.sharding._units import parameter_names, uncompiled

STAGE_KEYS = ("params", "state_dict", "buffers", "extra_states", "groups")


def writes_stage_meta(engine) -> bool:
    """Whether this rank gives its pipeline stage's part of the meta: the
    stage's first data- and tensor-parallel rank."""
    tp = engine._tensor_parallel
    return holds_a_part(engine) and engine._comm.everyone.rank == 0 and \
        (tp is None or tp.rank == 0)


def stage_part(engine, meta) -> dict:
    part = {key: meta[key] for key in STAGE_KEYS}
    part["order"] = _model_order(engine)
    return part


def _model_order(engine) -> dict:
    """Checkpoint name -> (global stage index, place in that stage) of each
    parameter this rank's stages hold ([Note: the whole model's order])."""
    module = uncompiled(engine.module)
    names = parameter_names(module)
    stages = zip(module._zero_stage_indices, module.stages) if is_chunked(module) \
        else [(engine._pipeline.index, module)]
    order = {}
    for index, stage in stages:
        for place, p in enumerate(stage.parameters()):
            if id(p) in names:
                order.setdefault(checkpoint_name(engine, names[id(p)]), (index, place))
    return order


def merged_stages(parts) -> dict:
    """The whole model's parameters, state dict entries, buffers and
    optimizer groups from each pipeline stage's (index, part); a tied
    copy's entries name the parameter it copies, so they merge into one.
    A group's hyperparameters must be the same on every stage that holds
    its parameters: a checkpoint keeps one set a group."""
    parts = [part for _index, part in sorted(parts, key=lambda p: p[0])]
    merged = {"params": {}, "state_dict": [], "buffers": {}, "extra_states": {}}
    groups = [dict(g, param_names=[], states=[]) for g in parts[0]["groups"]]
    keys, names = set(), [set() for _ in groups]
    order, settings = {}, [None] * len(groups)
    for part in parts:
        if len(part["groups"]) != len(groups):
            raise ValueError("the pipeline stages' optimizers have different numbers of param "
                             f"groups ({len(groups)} and {len(part['groups'])}); give every "
                             "stage's optimizer the same groups")
        merged["params"].update(part["params"])
        merged["buffers"].update(part["buffers"])
        merged["extra_states"].update(part["extra_states"])
        for name, place in part.get("order", {}).items():
            order[name] = min(order.get(name, place), place)
        for entry in part["state_dict"]:
            if entry[0] not in keys:
                keys.add(entry[0])
                merged["state_dict"].append(entry)
        for gi, (group, seen, stage_group) in enumerate(zip(groups, names, part["groups"])):
            if stage_group["param_names"]:
                settings[gi] = _same_settings(gi, settings[gi], stage_group["hyper"])
                group["hyper"] = settings[gi]
            group["param_names"] += [n for n in stage_group["param_names"] if n not in seen]
            seen.update(stage_group["param_names"])
            group["states"] = sorted(set(group["states"]) | set(stage_group["states"]))
            # the stages holding a group's parameters count its steps alike;
            # one holding none of them counts 0 (the first stage's count
            # alone restarted Adam's bias correction of a later stage's group)
            group["step"] = max(group["step"], stage_group["step"])
    if order:
        last = (float("inf"), 0)  # a name no stage ordered (none expected): kept at the end
        for group in groups:
            group["param_names"].sort(key=lambda name: order.get(name, last))
    merged["groups"] = groups
    return merged


def _same_settings(gi, first, hyper) -> dict:
    """`hyper`, checked against the settings another stage gave group gi:
    merged, the first stage's silently replaced the others' (a later
    stage's own learning rate was lost at the next load_checkpoint)."""
    if first is None or first == hyper:
        return hyper
    differ = sorted(k for k in set(first) | set(hyper) if first.get(k) != hyper.get(k))
    shown = ", ".join(f"{k} {first.get(k)!r} and {hyper.get(k)!r}" for k in differ[:4])
    raise ValueError(f"the pipeline stages' optimizers give param group {gi} different "
                     f"settings ({shown}); a checkpoint keeps one set a group, as one "
                     "optimizer over the whole model would: give the group the same settings "
                     "on every stage, or put the parameters that differ in a group of their own")

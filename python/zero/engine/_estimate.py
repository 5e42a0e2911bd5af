"""zero.estimate_memory: the model-state bytes one rank will hold, before
anything is allocated, for a world size and the options initialize takes.

It lays the model out with the engine's own rules (the same param groups,
stage 3's per-module units, the same padding and alignment, persistence,
the offload windows) and counts bytes instead of allocating them, so a
model built on the meta device (`with torch.device("meta"): model = ...`)
can be sized at any scale. The figures are exactly what
Engine.memory_summary() reports on every rank once training runs
(tests/test_estimate.py), except what only a run decides: stage 3's
gathered peak and the bucket peak of stages 2-3, given as None.
"""
from __future__ import annotations

import torch
from torch import nn

from zero.sharding import _flat_group
from zero.engine._arguments import default_optimizer, resolve_config
from zero.engine._memory import MemorySummary, zero_formula
from zero.offload import _param_staging
from zero.offload._nvme import PAGE_ELEMENTS, SLOTS, whole_pages, window_elements
from zero.step._registry import spec_for
from zero.step._step_path import states_off_device
from zero.sharding._policy import StagePolicy
from zero.sharding._units import PersistenceBudget, lay_out
from zero.sharding._unit_roots import unit_roots
from zero.engine._construction import match_param_groups, owners_of, units_of
from zero.engine._engine import DTYPES
from zero.parallel._mesh import is_data_parallel_line
from zero.parallel._tensor_parallel import localize, tensor_parallel_mesh


def _partitions_of_mesh(mesh, world_size) -> int:
    """How many ranks a mesh's partitions span: dp_shard's size (1 for a
    mesh of tp or pp alone), as initialize reads the mesh (parallel/_mesh.py)."""
    if hasattr(mesh, "mesh") and hasattr(mesh, "ndim"):  # a DeviceMesh
        if is_data_parallel_line(mesh):
            return mesh.size()
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if not names or any(n not in ("dp_replicate", "dp_shard", "tp", "pp") for n in names):
            raise ValueError("mesh: a DeviceMesh of more than one dimension must name them "
                             f"dp_replicate, dp_shard, tp, pp; got {names or 'unnamed'}")
        return mesh["dp_shard"].size() if "dp_shard" in names else 1
    else:
        shape = tuple(mesh) if isinstance(mesh, (tuple, list)) else (mesh,)
    if not 1 <= len(shape) <= 2 or \
            not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
        raise ValueError("mesh must be (dp_replicate, dp_shard) sizes, a 1-D size or a "
                         f"DeviceMesh of one or two dimensions, got {mesh!r}")
    total = shape[0] * (shape[1] if len(shape) == 2 else 1)
    if world_size not in (1, total):
        raise ValueError(f"world_size {world_size} differs from the mesh's {total} ranks; "
                         "leave it out")
    return shape[-1]


def estimate_memory(model: nn.Module, world_size: int = 1, *, optimizer=None, stage=None,
                    precision=None, config=None, device=None, mesh=None,
                    **options) -> MemorySummary:
    """One rank's model-state bytes, as memory_summary() will report them,
    for training `model` on `world_size` ranks; the other arguments are
    initialize's (optimizer None means the config's, default AdamW).
    mesh: the shape of a hybrid mesh, (dp_replicate, dp_shard), or a
    DeviceMesh as initialize takes it; a rank then holds 1/dp_shard of what
    is partitioned (world_size is the mesh's size, or left out). A model
    parallelized over the mesh's tp dimension (DTensor parameters) is
    counted by its local pieces: what this rank holds.
    device: where the model will train, "cpu" or "cuda" (default: where
    its parameters are; a meta model counts as "cpu"); with "cuda",
    offload_optimizer "cpu" or "nvme" puts the states in host memory,
    reported as `host`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    engine = getattr(model, "_zero_engine", None)
    if engine is not None and engine() is not None and not engine()._closed:
        # stage 3 has released its parameters: their shapes are (0,) now
        raise ValueError("model is already trained by an engine: its memory_summary() "
                         "gives these figures")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if mesh is not None:
        world_size = _partitions_of_mesh(mesh, world_size)
    cfg = resolve_config(config, stage, precision, options)
    where = _training_device(model, device)
    if optimizer is None:
        optimizer = default_optimizer(cfg, model)
    # a tensor-parallel model: what a rank holds is its local pieces
    # ([Note: local parameters]); the model is given back as it came
    local = localize(model, optimizer, tensor_parallel_mesh(model))
    try:
        return summary_for(model, optimizer, cfg, world_size, where)
    finally:
        if local is not None:
            local.restore(optimizer)


def summary_for(model, optimizer, cfg, world_size, where, frozen_only=False) -> MemorySummary:
    """estimate_memory's figures for a resolved config (cfg), the optimizer
    and the training device (where), of a model as it is (local pieces
    under tp): initialize asks it for the bytes its files will take.
    frozen_only: a model with nothing to train is counted too (zero.inference's)."""
    staged = states_off_device(where, cfg.offload_optimizer)
    # [Note: parameters off the device] in _param_staging.py
    shard_on_host = _param_staging.params_off_device(where, cfg.offload_param)
    grads_on_host = shard_on_host and staged
    # [Note: delayed update] in step/_delayed.py
    delayed = cfg.offload_optimizer.delayed_update
    own_master = _flat_group.has_own_master(cfg.precision == "fp32", staged, shard_on_host,
                                            delayed)
    return _estimate(model, optimizer, cfg, world_size, where, staged, shard_on_host,
                     grads_on_host, delayed, own_master, frozen_only)


def _estimate(model, optimizer, cfg, world_size, where, staged, shard_on_host, grads_on_host,
              delayed, own_master, frozen_only) -> MemorySummary:
    spec = spec_for(optimizer)
    groups = match_param_groups(model, optimizer)
    if not frozen_only and not any(params for params, _ in groups):
        raise ValueError("the model has no trainable parameters; nothing to train")
    policy = StagePolicy.of(cfg.stage)
    owners = owners_of(model, unit_roots(model, cfg.units, cfg.stage3_leaf_modules)) \
        if policy.partitions_params else None
    pb = DTYPES[cfg.precision].itemsize
    gb = DTYPES[cfg.grad_accum_dtype or cfg.precision].itemsize
    totals = {"params": 0, "grads": 0, "optimizer_states": 0, "offloaded": 0, "host": 0,
              "persistent": 0, "params_offloaded": 0}
    shapes = []  # (Ψ of the group, its number of states), for the formula
    persistence = PersistenceBudget.of(cfg, model)
    for index, (params, _names) in enumerate(groups):
        if not params:
            continue
        units = _layout(params, units_of(params, owners), policy, world_size)
        part = sum(u.part for u in units)
        states = len(spec.states(optimizer.param_groups[index]))
        params_bytes, persistent, params_offloaded = _param_bytes(units, part, pb, cfg, policy,
                                                                     persistence)
        if shard_on_host and not params_offloaded:  # the shard in host memory
            totals["host"] += params_bytes - persistent
            params_bytes = persistent
        totals["params"] += params_bytes
        totals["persistent"] += persistent
        totals["params_offloaded"] += params_offloaded
        grads = (part if policy.partitions_grads else units[0].total) * gb
        totals["host" if grads_on_host else "grads"] += grads
        kept, offloaded = _optimizer_bytes(part, states + own_master, cfg)
        totals["offloaded"] += offloaded
        if delayed:  # the update's copies of the gradients and parameters
            kept += part * (gb + pb)
        if staged and delayed:  # no windows then
            totals["host"] += kept
        elif staged:  # with the staged step's gradient and parameter windows
            window = max(1, min(_staging_chunk(cfg), part))
            # none for what is on the host already
            totals["host"] += kept + _flat_group.STAGING_SLOTS * window * (
                (0 if grads_on_host else gb) + (0 if shard_on_host else pb))
        else:
            totals["optimizer_states"] += kept
        shapes.append((sum(u.numel for u in units), states))
    trainable = {id(p) for params, _ in groups for p in params}
    frozen = [p for p in model.parameters() if id(p) not in trainable]
    totals["frozen_params"], frozen_offloaded, frozen_host = _frozen_bytes(
        frozen, owners, cfg, policy, world_size, pb, shard_on_host, persistence)
    totals["params_offloaded"] += frozen_offloaded
    totals["host"] += frozen_host
    totals["gathered_peak"] = None if policy.releases_params else 0
    totals["buckets"] = None if policy.reduces_in_backward else 0
    totals["model_states"] = totals["params"] + totals["grads"] + totals["optimizer_states"]
    formula, expected = zero_formula(cfg.stage, world_size, pb, gb,
                                     own_master, shapes, totals,
                                     staged=staged, shard_on_host=shard_on_host,
                                     grads_on_host=grads_on_host)
    return MemorySummary(totals, formula=formula, formula_bytes=expected,
                         world_size=world_size, stage=cfg.stage,
                         trainable_params=sum(numel for numel, _ in shapes), estimate=True)


def unit_totals(model, optimizer, cfg, world_size) -> tuple:
    """(the largest unit, the trainable units in all, every unit in all),
    in elements, as the engine lays stage 3's units out for `model` (a
    block by default, units= and the leaf modules taken in, padding
    included): the running unit and the most a run's gradient buckets and
    gathers can hold, which settings_that_fit counts. optimizer None: the
    config's (default AdamW)."""
    if optimizer is None:
        optimizer = default_optimizer(cfg, model)
    owners = owners_of(model, unit_roots(model, cfg.units, cfg.stage3_leaf_modules))
    policy = StagePolicy.of(3)
    groups = [params for params, _names in match_param_groups(model, optimizer) if params]
    trainable = {id(p) for params in groups for p in params}
    frozen = [p for p in model.parameters() if id(p) not in trainable and p.is_floating_point()]

    def totals(params):
        return [unit.total for unit in _layout(params, units_of(params, owners), policy,
                                               world_size)]
    trained = [t for params in groups for t in totals(params)]
    every = trained + (totals(frozen) if frozen else [])
    return max(every, default=0), sum(trained), sum(every)


def _training_device(model, device):
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
        return device
    where = next(model.parameters(), None)
    if where is None or where.device.type == "meta":
        return torch.device("cpu")
    return where.device


def _layout(params, unit_lists, policy, world_size):
    """The group's units, as FlatGroup lays them out (no storage)."""
    if unit_lists is None:
        unit_lists = [list(range(len(params)))]
    ordered = [params[i] for members in unit_lists for i in members]
    return lay_out(ordered, [len(m) for m in unit_lists], world_size if policy.partitions else 1)


def _param_bytes(units, part, pb, cfg, policy, persistence):
    """(parameter bytes in memory, of which persistent at stage 3, bytes
    in offload_param files): stages 0-2 hold the whole group; stage 3 its
    shard (in a file with offload_param "nvme") plus the units at or under
    the persistence thresholds, gathered for good ([Note: persistence])."""
    if not policy.partitions_params:
        return sum(u.total for u in units) * pb, 0, 0
    persistent = sum(u.total for u in units if persistence.takes(u)) * pb
    if cfg.offload_param.device == "nvme":
        return persistent, persistent, whole_pages(part * pb)
    return part * pb + persistent, persistent, 0


def _optimizer_bytes(part, files, cfg):
    """(bytes in RAM, bytes in offload files) of the fp32 master and states:
    `files` fp32 tensors of `part` elements each; offloaded to nvme, RAM
    keeps only the step's windows (_nvme.NvmeFiles.window_bytes), and
    each file takes whole pages on the disk."""
    whole = 4 * part * files
    offload = cfg.offload_optimizer
    if offload.device != "nvme" or part == 0:
        return whole, 0
    chunk = _file_chunk(offload)
    chunks = -(-part // chunk)
    return min(SLOTS, chunks) * window_elements(min(chunk, part)) * 4 * files, \
        whole_pages(4 * part) * files


def _staging_chunk(cfg):
    """Elements of a staged step's windows: the files' chunk for "nvme",
    else _flat_group.STAGING_CHUNK (read at call time)."""
    offload = cfg.offload_optimizer
    return _file_chunk(offload) if offload.device == "nvme" else _flat_group.STAGING_CHUNK


def _file_chunk(offload):
    """NvmeFiles' chunk: whole pages."""
    return max(PAGE_ELEMENTS, offload.chunk_elements // PAGE_ELEMENTS * PAGE_ELEMENTS)


def _frozen_bytes(frozen, owners, cfg, policy, world_size, pb, shard_on_host, persistence):
    """(bytes on the model's device, bytes in offload_param files, bytes
    in host memory apart from it) of the frozen parameters: at stage 3 the
    floating ones a group of their own (shard plus persistent units), the
    rest (and all at stages 0-2) whole, floating ones cast to the compute
    dtype; persistence: the trainable groups' budget left (the engine lays
    the frozen group out after them)."""
    if policy.partitions_params:
        whole = [p for p in frozen if not p.is_floating_point()]
        partitioned = [p for p in frozen if p.is_floating_point()]
    else:
        whole, partitioned = frozen, []
    total = sum(p.numel() * (pb if p.is_floating_point() else p.element_size()) for p in whole)
    offloaded = host = 0
    if partitioned:
        units = _layout(partitioned, units_of(partitioned, owners), policy, world_size)
        held, persistent, offloaded = _param_bytes(units, sum(u.part for u in units), pb, cfg,
                                                  policy, persistence)
        if shard_on_host and not offloaded:
            host, held = held - persistent, persistent
        total += held
    return total, offloaded, host

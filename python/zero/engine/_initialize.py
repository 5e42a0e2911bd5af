"""zero.initialize: one call from a plain torch model to a ZeRO engine."""
from __future__ import annotations

import dataclasses
import os
import weakref
import zlib

import torch
from torch import nn

from zero.comm._comm import Comm, join_process_group, leave_process_group
from zero.sharding._copying import EngineRef
from zero.sharding._param_marks import mark
from zero.parallel._mesh import describe_mesh, resolve_mesh
from zero.parallel._pipeline import PipelineLayout
from zero.parallel._tensor_parallel import localize
from zero.sharding._partitioned_init import sharded_record
from zero.config._schedulers import scheduler_from_config
from zero.step._threads import share_cores_among_local_ranks
from zero.config._config import Config, check_nvme_path
from zero.engine._arguments import default_optimizer, resolve_config
from zero.engine._carried_counts import take_counts
from zero.engine._disk_room import check_disk_room
from zero.engine._engine import Engine
from zero.engine._handback import resized


# initialize's arguments that only training reads
_TRAINING_ONLY = {"optimizer", "lr_scheduler", "gradient_clipping", "gradient_accumulation_steps",
                  "offload_optimizer", "loss_scaling", "train_batch_size",
                  "train_micro_batch_size_per_gpu", "grad_accum_dtype", "check_grad_overflow"}


def inference(model: nn.Module, *, stage: int = 3, precision=None, config=None, device=None,
              mesh=None, **options) -> Engine:
    """An engine that runs `model` without training it: every parameter is
    frozen (requires_grad=False) and partitioned as `stage` says (3: each
    rank keeps 1/N, each block gathered as it runs; with offload_param
    "cpu" or "nvme" the shards live in host memory or files and are
    streamed in, ZeRO-Inference), with no optimizer or gradient memory.
    Use it as the model (forward under torch.no_grad()), or
    engine.generate(...) with the parameters gathered once. backward,
    step and clip_grad_norm_ are refused. The model is put in eval mode
    (no dropout; .train() on the engine turns it back). For a frozen
    reference or reward model beside trained ones (zero.rlhf), and
    generation."""
    if isinstance(model, Engine):
        model = model.module
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    training = sorted(set(options) & _TRAINING_ONLY)
    if training:  # taken and ignored before (optimizer: "got multiple values")
        raise ValueError(f"zero.inference trains nothing: {', '.join(training)} would have no "
                         "effect; leave them out (zero.initialize trains)")
    if not any(True for _ in model.parameters()):
        raise ValueError("the model has no parameters; nothing to run partitioned")
    wanted = [(p, p.requires_grad) for p in model.parameters()]
    model.requires_grad_(False)
    # the engine keeps an optimizer's param groups to find the parameters;
    # this one never steps
    placeholder = torch.optim.SGD(model.parameters(), lr=0.0)
    try:
        engine = initialize(model, optimizer=placeholder, stage=stage, precision=precision,
                            config=config, device=device, mesh=mesh, _inference=True,
                            **options)
    except BaseException:
        # refused (a bad setting): the model as it came, not frozen for good
        for p, requires_grad in wanted:
            p.requires_grad_(requires_grad)
        raise
    engine._requires_grad_given = wanted  # close() gives them back
    return engine.eval()


def initialize(model: nn.Module, *, optimizer=None, stage=None, precision=None,
               config=None, lr_scheduler=None, device=None, mesh=None, _inference=False,
               **options) -> Engine:
    """Wrap `model` in place and return the Engine that trains it.

    optimizer: a torch.optim (AdamW, Adam, SGD, Adagrad) or zero.optim
        optimizer built on model.parameters(), or None for the config's
        optimizer block (default AdamW, lr 1e-3).
    stage: 0 (DDP), 1 (optimizer states partitioned), 2 (+ gradients),
        3 (+ parameters, gathered just in time a unit at a time: a
        repeated block, such as a transformer layer, by default).
    precision: "fp32", "bf16" or "fp16" (dynamic loss scaling).
    config: a zero.Config, or a DeepSpeed-style dict or JSON path.
    lr_scheduler: a scheduler on `optimizer`, or a callable
        optimizer -> scheduler; stepped by the engine on every update that
        is not skipped.
    device: where to train: None for the device the parameters are on, or
        "cpu", "cuda", "cuda:1", a torch.device. The model is moved there
        (a zero.partitioned_init model one parameter at a time); "cuda"
        without an index means cuda:LOCAL_RANK under a launcher (made the
        current device), else the current device.
    mesh: the data-parallel group ZeRO partitions over: None for the whole
        world, or a torch.distributed ProcessGroup or 1-D DeviceMesh that
        holds this rank (two engines can then train on two halves of the
        world). Ranks, partitions and checkpoints are the group's. A
        DeviceMesh with named dimensions: ZeRO partitions over `dp_shard`,
        keeps replicas over `dp_replicate` (hybrid sharding), trains a
        model parallelized over `tp` (parallelize_module on mesh["tp"];
        zero.parallel has plans) on its local pieces, and a pipeline stage
        over `pp` (zero.parallel.split_gpt / split_llama;
        docs/parallel.md).
    options: any other zero.Config field (gradient_accumulation_steps,
        gradient_clipping, reduce_bucket_size, ...).
    """
    if isinstance(model, Engine):
        # `model = zero.initialize(model)` run twice (a re-run notebook cell)
        model = model.module
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_not_wrapped(model)
    if torch.is_inference_mode_enabled():
        raise RuntimeError("zero.initialize was called inside torch.inference_mode(): the "
                           "engine's parameters would be inference tensors, which cannot be "
                           "trained. Call it outside")
    previous = getattr(model, "_zero_engine", None)
    if previous is not None and previous() is not None:
        # a re-run notebook cell: the old engine's hooks must not fire twice
        _check_states_kept(previous(), optimizer)
        previous().close()
    cfg = _absolute_nvme_paths(resolve_config(config, stage, precision, options))
    _check_parameters_free(model, partitions=cfg.stage == 3)
    path_problem = _nvme_path_problem(cfg)  # raised once the ranks know (below)
    if not any(True for _ in model.parameters()):
        raise ValueError("the model has no parameters; nothing to train")
    _check_dense_gradients(model)
    _check_real_parameters(model)
    _check_not_deepspeeds(model)
    device = _engine_device(model, device)
    if optimizer is None:
        optimizer = default_optimizer(cfg, model)
    share_cores_among_local_ranks()
    created = join_process_group(device, timeout=cfg.timeout)
    engine = tensor_parallel = None
    try:
        groups = resolve_mesh(mesh)
        _refused_on_every_rank(Comm(device, groups.whole or groups.everyone), path_problem,
                               describe_mesh(mesh))
        if groups.partial:
            _check_not_partitioned_over_the_world(model)
        comm = Comm(device, groups.shard)
        if groups.replicate is not None:
            comm.with_replicas(groups.replicate, groups.everyone)
        # [Note: local parameters] in parallel/_tensor_parallel.py
        if groups.tp_mesh is not None or groups.pp_mesh is not None:
            comm.with_model_parallel(groups.whole)
        tensor_parallel = localize(model, optimizer, groups.tp_mesh,
                                   Comm(device, groups.tp_mesh.get_group())
                                   if groups.tp_mesh is not None else None)
        pipeline = _pipeline_layout(model, optimizer, groups, device)
        if tensor_parallel is None and groups.tp_mesh is not None and groups.tp_mesh.size() > 1:
            raise ValueError(f"mesh has a 'tp' dimension of size {groups.tp_mesh.size()}, but "
                             "no parameter of the model is a DTensor over it: parallelize the "
                             "model first (parallelize_module(model, mesh['tp'], plan), or "
                             "zero.parallel.parallelize_gpt / parallelize_llama)")
        cfg = settle_batch_sizes(cfg, comm.dp_world)
        from_config = lr_scheduler is None and bool(cfg.scheduler)
        if lr_scheduler is None and cfg.scheduler:
            lr_scheduler = scheduler_from_config(cfg.scheduler, optimizer)
        elif isinstance(lr_scheduler, type):  # its step is a function of the class
            raise TypeError(f"lr_scheduler is the class {lr_scheduler.__name__}; pass a "
                            "scheduler built on the optimizer, or a callable optimizer -> "
                            "scheduler (functools.partial(StepLR, step_size=10))")
        elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            made = lr_scheduler(optimizer)
            if made is None:
                raise TypeError("lr_scheduler(optimizer) returned None; the callable must "
                                "return the scheduler it makes")
            lr_scheduler = made
        _check_scheduler(lr_scheduler, optimizer)
        # [Note: disk room]: before the engine's collectives make the files
        check_disk_room(model, optimizer, cfg, Comm(device, groups.whole or groups.everyone),
                        comm.world, device)
        engine = Engine(model, optimizer, cfg, comm, created, lr_scheduler,
                        tensor_parallel=tensor_parallel, pipeline=pipeline,
                        inference=_inference)
        engine._scheduler_from_config = from_config
        take_counts(engine)  # [Note: counts carried across close]
        model._zero_engine = EngineRef(engine)
        if cfg.stage != 3:  # its frozen parameters stay whole, in no group
            for p in model.parameters():
                if "_zero_place" not in p.__dict__:
                    mark(p, "_zero_held_whole", weakref.ref(engine))
        return engine
    except BaseException:
        if engine is None:
            if tensor_parallel is not None:  # the model and optimizer as they came
                tensor_parallel.restore(optimizer)
            leave_process_group(created)
        else:  # its finalizer leaves, once
            engine._leave_group()
        raise


def _check_states_kept(previous, optimizer):
    """Before initialize closes the live engine of the model: on several
    ranks close() leaves a trained optimizer's states partitioned (the
    optimizer then refuses a new initialize), so one given again would be
    refused only after the engine that held its states was gone."""
    if previous._closed or optimizer is None or optimizer is not previous.optimizer or \
            not any(fg.step_count > 0 for fg in previous.groups):
        return
    unfit = _states_that_would_not_fit(previous, optimizer)
    if unfit:
        raise ValueError(f"zero.initialize again with the live engine's optimizer: {unfit}. "
                         "The engine is left as it was (train on with it), and so is the "
                         "optimizer")
    if previous._comm.everyone.world == 1:
        return
    raise ValueError(
        "zero.initialize again on a model whose live engine trains it, with that engine's "
        f"optimizer, on {previous._comm.everyone.world} ranks: closing it would leave the "
        "optimizer's states partitioned over the ranks, and a new engine could not take them. "
        "The engine is left as it was: train on with it, or save_checkpoint() it, close() "
        "it, and give the new engine a new optimizer and load the checkpoint into it (or "
        "load consolidate(checkpoint)['optimizer'] into this optimizer first)")


def _states_that_would_not_fit(previous, optimizer) -> str:
    """What the optimizer's states, once close() gives them back, could
    not be laid out for: a parameter resized since (its states keep the old
    shape), or one that trains now beside stepped ones in its param group
    (one step count per group cannot start it afresh, where torch keeps one
    per parameter). Found before the old engine is closed: the new one's
    refusal came after, with the working engine gone."""
    trained = {id(p): (fg, j) for fg in previous.groups if fg.step_count > 0
               for j, p in enumerate(fg.params)}
    shapes = {id(p): shape for fg in previous.all_groups for unit in fg.units
              for p, shape in zip(unit.params, unit.shapes)}
    names = {id(p): name for name, p in previous.module.named_parameters()}
    for index, group in enumerate(optimizer.param_groups):
        params = group["params"]
        if not any(id(p) in trained for p in params):
            continue  # no states: its parameters start afresh together
        for p in params:
            name = names.get(id(p), "a parameter")
            if id(p) in trained and resized(p, shapes[id(p)]):
                return (f"parameter '{name}' was resized since the engine was made "
                        f"({tuple(shapes[id(p)])} -> {tuple(p.shape)}) and the optimizer's "
                        "states for it keep the old shape (torch's optimizer would not take "
                        "them either): give zero.initialize a new optimizer")
            if id(p) not in trained and p.requires_grad and p.is_floating_point():
                step = trained[next(id(q) for q in params if id(q) in trained)][0].step_count
                return (f"parameter '{name}' trains now but did not when the engine was made, "
                        f"and its param group {index} has states at step {step}: zero keeps "
                        "one step count per param group, so it cannot start this parameter "
                        "afresh beside them (torch keeps one per parameter). Build the "
                        "optimizer with the parameters you will unfreeze in param groups of "
                        "their own (a group without states starts afresh, as torch's would), "
                        "or give zero.initialize a new optimizer")
    return ""


def _check_not_wrapped(model):
    """A model in DDP or FSDP (accelerate's prepare() wraps it in DDP) was
    trained with both: the wrapper all-reduced every gradient and kept
    full-size buckets on top of zero's own reduction, silently, and the
    names took its 'module.' prefix."""
    kind = type(model)
    if isinstance(model, nn.parallel.DistributedDataParallel) or \
            kind.__name__ == "FullyShardedDataParallel" or \
            any(c.__name__ == "FSDPModule" for c in kind.__mro__):
        raise ValueError(f"model is wrapped in {kind.__name__}: zero does the data parallelism "
                         "itself; pass the model inside (model.module for DDP), not prepared "
                         "by accelerate or wrapped by torch")


def _absolute_nvme_paths(cfg):
    """cfg with its nvme_paths made absolute against the directory of now:
    files are made there at initialize and more later (close() gathers
    offloaded parameters into a new file beside the shards), and a script
    that changed directory in between made them elsewhere, or failed."""
    blocks = {}
    for name in ("offload_optimizer", "offload_param"):
        block = getattr(cfg, name)
        if block.nvme_path and not os.path.isabs(block.nvme_path):
            blocks[name] = dataclasses.replace(block, nvme_path=os.path.abspath(block.nvme_path))
    return dataclasses.replace(cfg, **blocks) if blocks else cfg


def _nvme_path_problem(cfg):
    """This rank's nvme_path refused (a ValueError), or None; checked
    before the model is touched. Paths may differ per rank, so one rank
    alone may refuse: _refused_on_every_rank makes the others raise too."""
    try:
        if cfg.offload_optimizer.device == "nvme":
            check_nvme_path(cfg.offload_optimizer.nvme_path)
        if cfg.offload_param.device == "nvme":
            check_nvme_path(cfg.offload_param.nvme_path, "offload_param.nvme_path")
    except ValueError as error:
        return error
    return None


def _refused_on_every_rank(comm, problem, layout: str):
    """Raise `problem` here and an error naming the ranks that refused on
    every other rank (a collective, the engine's first): a rank that raised
    alone left the others waiting in the engine's first collective until
    the process group's timeout (30 minutes in a group torch made). The
    ranks compare the mesh they passed (`layout`, describe_mesh's) in the
    same gather: ranks given other meshes (another shape, the dimensions
    named the other way round, None on one rank) went on into collectives
    on groups that never pair, and waited out that timeout."""
    if comm.world > 1:
        digest = zlib.crc32(layout.encode())
        every = comm.gather_ints([int(problem is not None), digest])
        refused = [r for r, (bad, _digest) in enumerate(every) if bad]
        if refused and problem is None:
            raise ValueError(f"zero.initialize: rank(s) {refused} refused their nvme_path (each "
                             "rank checks its own; their errors say why), so no rank goes on")
        others = [r for r, (_bad, theirs) in enumerate(every) if theirs != digest]
        if others and problem is None:
            raise ValueError(f"mesh: the ranks passed other meshes: this rank (rank "
                             f"{comm.rank} of the group) passed {layout}, rank(s) {others} "
                             "another. Pass the same mesh (or group, or None) on every rank")
    if problem is not None:
        raise problem


def _pipeline_layout(model, optimizer, groups, device):
    """The engine's PipelineLayout for a mesh with a pp dimension (None
    without): its stage (split_gpt / split_llama say which, and what is
    tied)."""
    if groups.pp_mesh is None:
        if getattr(model, "_zero_pipeline", None) is not None:
            raise ValueError("the model is a pipeline stage (split_gpt / split_llama) but the "
                             "mesh has no 'pp' dimension; pass the mesh it was split over")
        return None
    info = getattr(model, "_zero_pipeline", None)
    if info is not None and (info.index, info.count) != (groups.pp_mesh.get_local_rank(),
                                                         groups.pp_mesh.size()):
        raise ValueError(f"the model is stage {info.index} of {info.count}, but this rank is "
                         f"stage {groups.pp_mesh.get_local_rank()} of {groups.pp_mesh.size()} "
                         "on the mesh's pp dimension; split the model over mesh['pp']")
    return PipelineLayout(Comm(device, groups.pp_mesh.get_group()), info,
                          dict(model.named_parameters()), optimizer)


def _check_not_partitioned_over_the_world(model: nn.Module) -> None:
    """zero.partitioned_init partitions over the whole world, and taking a
    placeholder's values is a collective of every rank: an engine on a
    part of the world would wait for ranks that are not in it."""
    for name, p in model.named_parameters():
        if sharded_record(p) is not None:
            raise ValueError(f"parameter '{name}' was built under zero.partitioned_init(), "
                             "which partitions over the whole world, but mesh= names a part "
                             "of it; build the model without partitioned_init to train it "
                             "on a group")


def _check_parameters_free(model: nn.Module, partitions: bool) -> None:
    """Refuse parameters another live engine trains (a model containing an
    engine's model, or a part of one) and stage-3 placeholders whose
    values are gone (an engine dropped without close(), or an initialize
    that failed half-way). partitions: the new engine is at stage 3, so a
    frozen parameter a stage 0-2 engine keeps whole (in no group) is
    refused too: released to a placeholder, it left that engine's model
    empty and its checkpoints unreadable."""
    for name, p in model.named_parameters():
        place = p.__dict__.get("_zero_place")
        owner = place.engine() if place is not None else None
        if owner is None and partitions and "_zero_held_whole" in p.__dict__:
            owner = p._zero_held_whole()
        if owner is not None and not owner._closed:
            raise ValueError(f"parameter '{name}' is trained by another zero engine (this "
                             "model contains that engine's model, or is a part of it, or "
                             "shares this parameter with it): call that engine's close() "
                             "first, or give each model its own copy")
        # (values put back since, p.data = a whole tensor, count again)
        lost = p.numel() == 0 and (p.__dict__.get("_zero_lost", False) or
                                   (place is not None and not place.unit.gathered))
        if lost:
            raise ValueError(f"parameter '{name}' holds no values: a stage-3 engine released "
                             "it, and then its initialize failed or it was dropped without "
                             "close(), which gives the values back. Build the model again")


def settle_batch_sizes(cfg: Config, world: int) -> Config:
    """DeepSpeed's rule for train_batch_size = micro batch x accumulation x
    world size: given the total and one of the other two, the third is
    derived (the total alone: no accumulation); given all three, they must
    agree."""
    total, micro, accumulation = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                                  cfg.gradient_accumulation_steps)
    if total is None:
        return cfg
    if accumulation is None:
        accumulation = 1 if micro is None else total // (micro * world)
    if micro is None:
        micro = total // (accumulation * world)
    if micro < 1 or accumulation < 1 or micro * accumulation * world != total:
        derived = [name for name, given in (("micro batch", cfg.train_micro_batch_size_per_gpu),
                                            ("accumulation", cfg.gradient_accumulation_steps))
                   if given is None]
        raise ValueError(
            f"train_batch_size {total} != micro batch {cfg.train_micro_batch_size_per_gpu} x "
            f"accumulation {cfg.gradient_accumulation_steps} x world size {world}" +
            (f" (the {' and '.join(derived)} not given, and no whole number fits)"
             if derived else ""))
    return cfg.replace(train_micro_batch_size_per_gpu=micro,
                       gradient_accumulation_steps=accumulation)


def _check_dense_gradients(model: nn.Module) -> None:
    """Sparse gradients (an embedding with sparse=True) cannot go through
    the flat buckets and partitions, which hold dense gradients."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and \
                module.weight.requires_grad:
            raise ValueError(f"module '{name or type(module).__name__}' is an "
                             f"{type(module).__name__} with sparse=True: zero reduces and "
                             "partitions dense gradients; build it with sparse=False")


def _check_real_parameters(model: nn.Module) -> None:
    """A trainable complex parameter would be copied into the flat buffers,
    which hold real numbers, and lose its imaginary part (torch only warns,
    once). A frozen one is kept as it is on every rank, like an integer one."""
    for name, p in model.named_parameters():
        if p.requires_grad and p.is_complex():
            raise ValueError(
                f"parameter '{name}' is complex ({str(p.dtype).replace('torch.', '')}): zero "
                "trains real parameters only, in flat real buffers, where its imaginary part "
                "would be lost. Keep it as a real tensor with a last dimension of 2 "
                "(torch.view_as_real) and view it as complex in forward "
                "(torch.view_as_complex), or make it a buffer (register_buffer: kept as it "
                "is, also in checkpoints)")


def _check_not_deepspeeds(model: nn.Module) -> None:
    """A model partitioned by DeepSpeed's own zero.Init (transformers'
    HfDeepSpeedConfig with deepspeed installed builds one) holds empty
    parameters whose values live in DeepSpeed's ds_tensor: taken as they
    were, it failed in the forward on a shape ("'weight' must be 2-D")."""
    for name, p in model.named_parameters():
        if hasattr(p, "ds_tensor") and sharded_record(p) is None:
            raise ValueError(
                f"parameter '{name}' was partitioned by DeepSpeed's own zero.Init (it has "
                "ds_tensor): zero cannot read DeepSpeed's partitions. Build the model under "
                "zero.deepspeed.zero.Init (zero.partitioned_init) instead, or without it; "
                "with transformers, do not create HfDeepSpeedConfig (it makes from_pretrained "
                "and from_config use DeepSpeed's zero.Init)")


def _check_scheduler(lr_scheduler, optimizer) -> None:
    if lr_scheduler is None:
        return
    if not callable(getattr(lr_scheduler, "step", None)):
        raise TypeError("lr_scheduler must be a scheduler (with a step() method) or a callable "
                        f"that makes one from the optimizer, got {type(lr_scheduler).__name__}")
    bound = getattr(lr_scheduler, "optimizer", optimizer)
    if bound is not optimizer:
        raise ValueError("lr_scheduler was built on another optimizer than the one the engine "
                         "trains with; build it on the optimizer passed to initialize")


def _engine_device(model: nn.Module, device) -> torch.device:
    """The device the engine trains on: `device` when given (the engine
    moves the model there as it casts it), else the one device the model's
    parameters are on. The engine keeps its buffers there and picks the
    step for it (_step_path)."""
    current = {p.device for p in model.parameters()}
    if any(d.type == "meta" for d in current):
        raise ValueError("the model has parameters on the meta device (no values); build it "
                         "under zero.partitioned_init() instead, or materialise it first "
                         "(model.to_empty(device=...) and initialise the values)")
    if device is None:
        if len(current) > 1:
            names = ", ".join(sorted(str(d) for d in current))
            raise ValueError(f"the model's parameters are on several devices ({names}); zero "
                             "trains a model on one device per rank: pass device=, or move it "
                             "with model.to(device)")
        target = current.pop()
    else:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"device={device!r} is not a device ({error})") from None
        if target.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={device!r}, but torch.cuda.is_available() is False "
                                 f"here (torch {torch.__version__}); train on device='cpu'")
            if target.index is None:
                # ranks beyond the node's GPUs share them ([Note:
                # host-staged collectives])
                local = os.environ.get("LOCAL_RANK")
                target = torch.device("cuda", int(local) % torch.cuda.device_count()
                                      if local is not None else torch.cuda.current_device())
                if local is not None:
                    torch.cuda.set_device(target)  # the rank's own GPU, as torchrun means
    if target.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"zero trains on cpu and cuda devices, not on {target}")
    return target

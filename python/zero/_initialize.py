"""zero.initialize: one call from a plain torch model to a ZeRO engine."""
from __future__ import annotations

import weakref

import torch
from torch import nn

from zero._comm import Comm, join_process_group, leave_process_group
from zero._optimizer_bridge import optimizer_from_config
from zero._schedulers import scheduler_from_config
from zero.config import Config
from zero.engine import Engine


def initialize(model: nn.Module, *, optimizer=None, stage=None, precision=None,
               config=None, lr_scheduler=None, **options) -> Engine:
    """Wrap `model` in place and return the Engine that trains it.

    optimizer: a torch.optim (AdamW, Adam, SGD, Adagrad) or zero.optim
        optimizer built on model.parameters(), or None for the config's
        optimizer block (default AdamW, lr 1e-3).
    stage: 0 (DDP), 1 (optimizer states partitioned), 2 (+ gradients),
        3 (+ parameters, gathered per module just in time).
    precision: "fp32", "bf16" or "fp16" (dynamic loss scaling).
    config: a zero.Config, or a DeepSpeed-style dict or JSON path.
    lr_scheduler: a scheduler on `optimizer`, or a callable
        optimizer -> scheduler; stepped by the engine on every update that
        is not skipped.
    options: any other zero.Config field (gradient_accumulation_steps,
        gradient_clipping, reduce_bucket_size, ...).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    previous = getattr(model, "_zero_engine", None)
    if previous is not None and previous() is not None:
        # a re-run notebook cell: the old engine's hooks must not fire twice
        previous().close()
    if config is None:
        cfg = Config()
    elif isinstance(config, Config):
        cfg = config
    else:
        cfg = Config.from_deepspeed(config)
    if stage is not None:
        options["stage"] = stage
    if precision is not None:
        options["precision"] = precision
    cfg = cfg.replace(**options) if options else cfg
    if not any(True for _ in model.parameters()):
        raise ValueError("the model has no parameters; nothing to train")
    device = _model_device(model)
    if optimizer is None:
        optimizer = optimizer_from_config(cfg.optimizer or {"type": "AdamW",
                                                            "params": {"lr": 1e-3}},
                                          model.parameters())
    created = join_process_group(device)
    try:
        comm = Comm(device)
        if cfg.train_batch_size is not None and cfg.train_micro_batch_size_per_gpu:
            expected = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps \
                * comm.world
            if expected != cfg.train_batch_size:
                raise ValueError(
                    f"train_batch_size {cfg.train_batch_size} != micro batch "
                    f"{cfg.train_micro_batch_size_per_gpu} x accumulation "
                    f"{cfg.gradient_accumulation_steps} x world size {comm.world}")
        if lr_scheduler is None and cfg.scheduler:
            lr_scheduler = scheduler_from_config(cfg.scheduler, optimizer)
        elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(optimizer)
        engine = Engine(model, optimizer, cfg, comm, created, lr_scheduler)
        model._zero_engine = weakref.ref(engine)
        return engine
    except BaseException:
        leave_process_group(created)
        raise


def _model_device(model: nn.Module) -> torch.device:
    """The one device the model's parameters are on: the engine keeps its
    buffers there and picks the step for it (_step_path)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"the model's parameters are on several devices ({names}); zero trains "
                         "a model on one device per rank: move it with model.to(device)")
    device = devices.pop()
    if device.type == "meta":
        raise ValueError("the model's parameters are on the meta device (no values); build it "
                         "under zero.partitioned_init() instead, or materialise it first "
                         "(model.to_empty(device=...) and initialise the values)")
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"the model's parameters are on {device}; zero trains on "
                                  "cpu and cuda devices only")
    return device

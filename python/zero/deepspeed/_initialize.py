"""deepspeed.initialize on zero's engine: DeepSpeed's arguments and its
4-tuple (engine, optimizer, training dataloader, lr scheduler)."""
from __future__ import annotations

import json
import os

import torch

from zero._warnings import warn_user
from zero.config._config import Config
from zero.config._values import auto_refused
from zero.deepspeed._distributed import init_distributed
from zero.deepspeed.utils._logging import logger, set_log_level_from_string
from zero.engine._initialize import initialize as zero_initialize
from zero.optim._from_config import optimizer_from_config


def initialize(args=None, model=None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port=29500, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """(engine, optimizer, training_dataloader, lr_scheduler), as
    deepspeed.initialize returns them.

    The config comes from `config` (a dict or a JSON path), `config_params`
    (the same), or args.deepspeed_config. `optimizer` may be a torch
    optimizer, a callable taking the model's parameters (DeepSpeed's
    optimizer factory), or None for the config's "optimizer" block over
    `model_parameters` (default: all the model's parameters).
    `training_data` (a torch Dataset) gives a DataLoader of the config's
    micro-batch size, sampled over the data-parallel ranks with
    DistributedSampler, as DeepSpeed builds it; train_batch() draws from
    it. `mpu` (Megatron's model-parallel unit) maps onto the engine as
    [Note: mpu] in parallel/_mpu.py says: ZeRO over its data-parallel
    group, the norm over its model-parallel group. `mesh_param`
    (DeepSpeed's mesh shape) is refused: pass zero.initialize(mesh=...) a
    DeviceMesh."""
    if model is None:
        raise ValueError("deepspeed.initialize: model is None; pass model=your_module")
    if mesh_param is not None:
        raise NotImplementedError(
            "deepspeed.initialize(mesh_param=...): DeepSpeed's mesh shape is not read, so "
            "it is refused rather than ignored; build a DeviceMesh (init_device_mesh, "
            "dimensions dp_replicate/dp_shard/tp/pp) and pass zero.initialize(model, "
            "mesh=mesh) (docs/parallel.md)")
    cfg = _config(args, config, config_params)
    _take_local_rank(args)
    if dist_init_required is not False:
        # the group made here is the engine's only: a "comms_timeout" in the
        # config sets its timeout, as it does for a group zero.initialize
        # makes (DeepSpeed's DEEPSPEED_TIMEOUT otherwise)
        init_distributed(distributed_port=distributed_port,
                         dist_init_required=dist_init_required, timeout=cfg.timeout,
                         timeout_from='"comms_timeout" in the config')
    params = list(model_parameters) if model_parameters is not None else None
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and \
            callable(optimizer):
        # DeepSpeed's optimizer factory: called with the parameters
        optimizer = optimizer(params if params is not None else model.parameters())
    elif optimizer is None and cfg.optimizer is not None:
        optimizer = optimizer_from_config(cfg.optimizer,
                                          params if params is not None else model.parameters())
    elif optimizer is None:
        warn_user("deepspeed.initialize: no optimizer and no \"optimizer\" block in the config. "
                  "DeepSpeed builds an engine that cannot step; zero's needs an optimizer, so it "
                  "uses torch.optim.AdamW(lr=1e-3): engine.step() would train with it", UserWarning)
    layout = None
    if mpu is not None:  # [Note: mpu]: its groups exist once the process group does
        from zero.parallel._mpu import MegatronParallel
        layout = MegatronParallel(mpu, model)
    engine = zero_initialize(model, optimizer=optimizer, config=cfg,
                             lr_scheduler=lr_scheduler,
                             mesh=layout.dp_group if layout is not None else None)
    engine._mpu = layout.connect(engine.device) if layout is not None else None
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank  # aligned, as DeepSpeed aligns it
    loader = None
    if training_data is not None:
        loader = engine.deepspeed_io(training_data, collate_fn=collate_fn)
        engine.set_dataloader(loader)  # train_batch()'s, as DeepSpeed's pipeline engine
    engine.training_dataloader = loader  # DeepSpeed's attribute (None without data)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _config(args, config, config_params) -> Config:
    """The run's Config, from wherever DeepSpeed would read it."""
    if config is not None and config_params is not None:
        raise ValueError("deepspeed.initialize: give config or config_params, not both "
                         "(DeepSpeed refuses both too)")
    source = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None)
        if from_args is None and getattr(args, "deepscale_config", None) is not None:
            from_args = args.deepscale_config
            logger.warning("--deepscale_config is deprecated (in DeepSpeed too); use "
                           "--deepspeed_config")
    if source is not None and from_args is not None:
        raise ValueError("deepspeed.initialize: a config was passed and args.deepspeed_config "
                         f"names {from_args!r} too; give one (DeepSpeed refuses both)")
    source = source if source is not None else from_args
    if source is None:
        raise ValueError("deepspeed.initialize: no DeepSpeed config: pass config= (a dict or "
                         "a JSON path), or args with --deepspeed_config "
                         "(deepspeed.add_config_arguments adds it)")
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            source = json.load(f)
    cfg = Config.from_deepspeed(source)
    if cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu is None:
        # DeepSpeed asserts it; accepted, the batch-size queries answered None
        autos = [key for key in ("train_micro_batch_size_per_gpu", "train_batch_size")
                 if isinstance(source, dict) and source.get(key) == "auto"]
        if autos:  # an HF template's, used outside the Trainer
            raise auto_refused(autos[0], "give the number")
        raise ValueError("deepspeed.initialize: the config gives neither train_batch_size nor "
                         "train_micro_batch_size_per_gpu; give one (DeepSpeed requires it too: "
                         "the engine's batch-size queries and its training loader read it)")
    # DeepSpeed's logger (and its handler) at the config's level, as its
    # engine sets it: a script's own logger.info and log_dist lines show
    level = source.get("log_level") if isinstance(source, dict) else None
    if level is not None:
        set_log_level_from_string(level)
    return cfg


def _take_local_rank(args):
    """A script's --local_rank (DeepSpeed's launcher, the old
    torch.distributed.launch pass it) against the launcher's LOCAL_RANK:
    one that disagrees is refused, as DeepSpeed refuses it; where the
    environment has none, the argument is taken into it, so the engine
    (its local_rank, its GPU) reads the same number."""
    local = getattr(args, "local_rank", None) if args is not None else None
    if local is None or isinstance(local, bool) or not isinstance(local, int):
        if local is not None:
            raise TypeError(f"deepspeed.initialize: args.local_rank must be an int, got "
                            f"{local!r}")
        return
    if local < 0:
        return  # the argument's default: nothing said
    env = os.environ.get("LOCAL_RANK")
    if env is None:
        os.environ["LOCAL_RANK"] = str(local)
    elif env.strip() != str(local):
        raise ValueError(f"deepspeed.initialize: args.local_rank is {local} but the launcher's "
                         f"LOCAL_RANK is {env}; they must name the same rank")

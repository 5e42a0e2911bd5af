"""What the arguments of zero.initialize, estimate_memory and
settings_that_fit resolve to: the Config, and the optimizer when none is
given."""
from __future__ import annotations

import torch
from torch import nn

from zero.config._config import Config
from zero.optim._from_config import optimizer_from_config


def resolve_config(config, stage, precision, options) -> Config:
    """The Config that initialize's arguments describe."""
    if config is None:
        cfg = Config()
    elif isinstance(config, Config):
        cfg = config
    else:
        cfg = Config.from_deepspeed(config)
    options = dict(options)
    if stage is not None:
        options["stage"] = stage
    if precision is not None:
        options["precision"] = precision
    return cfg.replace(**options) if options else cfg


def default_optimizer(cfg: Config, model: nn.Module):
    """The config's optimizer block on the model, else torch's AdamW with
    lr 1e-3 and its other defaults."""
    if cfg.optimizer is None:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return optimizer_from_config(cfg.optimizer, model.parameters())

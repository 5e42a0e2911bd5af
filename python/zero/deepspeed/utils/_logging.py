"""deepspeed.utils.logger and log_dist: the logger DeepSpeed scripts log
through (`from deepspeed.utils import logger, log_dist`), as DeepSpeed
sets its own up: WARNING and up, the logger and its handler both
(DeepSpeed 0.19.8's level: a script's logger.info and log_dist's default
INFO print nothing until the config's "log_level", or
set_log_level_from_string, lowers both) to stdout with time, level and
place, not passed on to the root logger (so a script's
logging.basicConfig does not print each line twice). log_dist(message,
ranks) logs "[Rank r] message" where DeepSpeed would: on every process
before any process group exists; after, only on the listed ranks ([-1]:
all; none listed: none). log_dist_once and logger.warning_once log each
distinct message once per process, as DeepSpeed's do."""
from __future__ import annotations

import functools
import logging
import sys

from zero.comm._world import torch_distributed

logger = logging.getLogger("zero.deepspeed")
if not logger.handlers:
    _handler = logging.StreamHandler(stream=sys.stdout)
    _handler.setFormatter(logging.Formatter(
        "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
    _handler.setLevel(logging.WARNING)
    logger.addHandler(_handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}


def set_log_level_from_string(log_level_str, custom_logger=None):
    """The logger (this one by default) and its handlers at the named
    level; what a DeepSpeed config's "log_level" does at initialize."""
    if not isinstance(log_level_str, str) or log_level_str.lower() not in LEVELS:
        raise ValueError(f"log_level {log_level_str!r} is not one of {sorted(LEVELS)}")
    level = LEVELS[log_level_str.lower()]
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    return logger.getEffectiveLevel()


@functools.lru_cache(None)
def warning_once(*args, **kwargs):
    """logger.warning, once for each distinct message in this process."""
    logger.warning(*args, **kwargs)


logger.warning_once = warning_once


def log_dist(message, ranks=None, level=logging.INFO):
    """Log `message` with this rank's prefix on the listed ranks."""
    text = _for_this_rank(message, ranks)
    if text is not None:
        logger.log(level, text)


@functools.lru_cache(None)
def _log_dist_once(message, ranks, level):
    log_dist(message, None if ranks is None else list(ranks), level)


def log_dist_once(message, ranks=None, level=logging.INFO):
    """log_dist, once for each distinct (message, ranks, level) in this
    process."""
    _log_dist_once(message, None if ranks is None else tuple(ranks), level)


logger.log_dist_once = log_dist_once


def _for_this_rank(message, ranks):
    dist = torch_distributed()
    if not dist.is_initialized():
        return f"[Rank -1] {message}"
    rank = dist.get_rank()
    ranks = list(ranks or ())
    if ranks and (ranks[0] == -1 or rank in ranks):
        return f"[Rank {rank}] {message}"
    return None

"""deepspeed.utils.logger and log_dist: the logger DeepSpeed scripts log
through (`from deepspeed.utils import logger, log_dist`), as DeepSpeed
sets its own up: WARNING and up (DeepSpeed 0.19.8's level: a script's
logger.info and log_dist's default INFO print nothing until
logger.setLevel(logging.INFO)) to stdout with time, level and place, not
passed on to the root logger (so a script's logging.basicConfig does not
print each line twice). log_dist(message, ranks) logs "[Rank r] message"
where DeepSpeed would: on every process before any process group exists;
after, only on the listed ranks ([-1]: all; none listed: none)."""
from __future__ import annotations

import logging
import sys

from zero.comm._world import torch_distributed

logger = logging.getLogger("zero.deepspeed")
if not logger.handlers:
    _handler = logging.StreamHandler(stream=sys.stdout)
    _handler.setFormatter(logging.Formatter(
        "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False


def log_dist(message, ranks=None, level=logging.INFO):
    """Log `message` with this rank's prefix on the listed ranks."""
    text = _for_this_rank(message, ranks)
    if text is not None:
        logger.log(level, text)


def _for_this_rank(message, ranks):
    dist = torch_distributed()
    if not dist.is_initialized():
        return f"[Rank -1] {message}"
    rank = dist.get_rank()
    ranks = list(ranks or ())
    if ranks and (ranks[0] == -1 or rank in ranks):
        return f"[Rank {rank}] {message}"
    return None

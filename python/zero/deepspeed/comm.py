"""deepspeed.comm's calls that training scripts make about the comms
logger: log_summary() prints the totals of the config's comms_logger
(engine/_step_logs.py) for the engine that logged last, on the rank that
logs (global rank 0); elsewhere, and without a comms_logger, nothing."""
from __future__ import annotations

from zero.engine._step_logs import latest_comms_logger


def log_summary(show_straggler=False):
    """The comms logger's table: per operation, calls, total MiB and MiB a
    step. show_straggler (DeepSpeed's per-rank latency spread) is accepted
    and not reported: zero counts bytes, not latencies."""
    logger = latest_comms_logger()
    if logger is not None:
        logger.log_summary()

"""Holding back Ctrl-C (a notebook's stop button) while a step's update and
its bookkeeping run, so that the step is either whole or not taken.

KeyboardInterrupt is raised between Python bytecodes: one that arrives
during the C core's update is delivered just after it returns, when the
partitions and states have taken the update but the step counts, the
schedule and the gradients have not been moved on. Training on from there
applied that batch's gradient a second time, or reused a step number in
Adam's bias correction. So the update runs with SIGINT recorded rather than
raised, and the interrupt is delivered once the step is complete.
"""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_held():
    """Run the body with SIGINT recorded; then raise it again, to whatever
    handler was in place, if it came. Only the main thread receives
    signals in Python, so elsewhere this holds nothing; nor where the
    handler was installed outside Python (it could not be put back)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is None:
        yield
        return
    received = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except (ValueError, OSError):  # no signal support here (an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)  # as if it came now

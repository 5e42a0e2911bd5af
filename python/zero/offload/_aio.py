"""The process's disk I/O engine for offload files: one zero._C.Aio
(csrc/aio.c), made at first use and shared by every engine's files, and
the settings it is made with.

[Note: disk I/O] The offloaded step's reads and writes go through the C
core's engine, not Python threads: requests are cut into blocks of
`block_size` bytes, at most `queue_depth` in flight, on io_uring where
the kernel allows it and on a pool of pthreads otherwise (aio_info() says
which; ZERO_AIO=threads forces the pool). Short transfers are resumed in
C; a failed request raises OSError with its errno and the byte offset,
which Transfers turns into a message naming the file. Waits release the
GIL, so the update of the C core and the transfers overlap.

A forked child has none of the parent's engine threads: it forgets the
parent's engine and makes its own at first use.
"""
from __future__ import annotations

import os
import threading

from zero._C import Aio, aio_info

QUEUE_DEPTH = 32        # blocks in flight
BLOCK_SIZE = 1 << 20    # bytes a block

# the engine's settings, and whether write_through files are read and
# written with O_DIRECT ([Note: direct I/O] in _nvme.py)
_settings = dict(backend="auto", queue_depth=QUEUE_DEPTH, block_size=BLOCK_SIZE)
_direct = False
_engine = None
_lock = threading.Lock()


def _forget_in_child():
    global _engine, _lock
    _engine, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def engine() -> Aio:
    """The shared engine, made with the current settings at first use."""
    global _engine
    with _lock:
        if _engine is None:
            _engine = Aio(**_settings)
        return _engine


def set_io(backend: str | None = None, queue_depth: int | None = None,
           block_size: int | None = None, direct: bool | None = None) -> dict:
    """Change the engine's settings (None keeps one); returns the previous
    ones. The next step makes a new engine with them; requests already in
    flight finish on the old one, which their files hold until waited.
    backend: "auto", "io_uring" or "threads"; direct: O_DIRECT for
    write_through files where their filesystem allows it."""
    global _engine, _direct
    if direct is not None and not isinstance(direct, bool):
        raise ValueError(f"direct must be True or False, got {direct!r}")
    new = dict(_settings)
    for key, value in (("backend", backend), ("queue_depth", queue_depth),
                       ("block_size", block_size)):
        if value is not None:
            new[key] = value
    made = Aio(**new)  # refuses bad settings by name before anything changes
    with _lock:
        previous = dict(_settings, direct=_direct)
        _settings.update(new)
        _engine = made
        _direct = _direct if direct is None else direct
    return previous


def direct() -> bool:
    """Whether write_through files move with O_DIRECT (set_io)."""
    return _direct


def io_info() -> dict:
    """The settings, the backend the engine runs (or would run), and why
    io_uring does not, where it does not."""
    info = aio_info()
    current = _engine.backend if _engine is not None else None
    return dict(_settings, direct=_direct, active=current or (info["default"] if _settings["backend"] == "auto"
                                              else _settings["backend"]),
                io_uring=info["io_uring"], io_uring_error=info["io_uring_error"])


class Transfers:
    """The requests one set of files has in flight on an engine, so they
    can be waited for by name, and all of them before the files close or
    after a step was cut short."""

    def __init__(self, what: str, directory: str):
        self.what, self.directory = what, directory
        self.aio = None
        self.pending = {}  # request id -> (name, writing)

    def begin(self):
        """Before a step: wait for what a cut-short step left, then take the
        engine of the current settings (set_io)."""
        self.drain()
        self.aio = None

    def submit(self, writing: bool, name: str, fd: int, tensor, offset: int) -> int:
        if self.aio is None:
            self.aio = engine()
        call = self.aio.submit_write if writing else self.aio.submit_read
        request = call(fd, tensor, offset)
        self.pending[request] = (name, writing)
        return request

    def finish(self, requests):
        """Wait for every request, then raise the first failure (named)."""
        failure = None
        for request in requests:
            try:
                self._wait(request)
            except OSError as e:
                failure = failure or e
        if failure is not None:
            raise failure

    def drain(self):
        """Wait for everything still in flight, dropping failures: a step
        that was cut short has raised already."""
        for request in list(self.pending):
            try:
                self._wait(request)
            except (OSError, ValueError):
                pass

    def _wait(self, request):
        name, writing = self.pending[request]
        try:
            self.aio.wait(request)
        except OSError as e:
            del self.pending[request]
            raise self._named(e, name, writing) from None
        except ValueError:  # not in flight: nothing to wait for
            del self.pending[request]
            raise
        # (an interrupt leaves it pending: the engine still holds its window)
        del self.pending[request]

    def _named(self, e: OSError, name: str, writing: bool) -> OSError:
        what = "writing" if writing else "reading"
        where = f"{self.what}: {what} '{name}' at byte {getattr(e, 'offset', 0):,} in " \
                f"{self.directory!r}"
        if e.errno is None:
            return OSError(f"{where} moved no bytes (the file is shorter than the partition)")
        return OSError(e.errno, f"{where} failed ({os.strerror(e.errno)}); this step is "
                                "partly applied, load a checkpoint to go on")

"""The handles zero's async collectives return: wait() and is_completed(),
as torch's Work, around one collective, several, or one staged through host
memory ([Note: host-staged collectives] in _host_staging.py)."""
from __future__ import annotations


class Watched:
    """An async collective's handle whose wait() names a timeout:
    on_error(error, op, group) (_comm's raise_if_timed_out) raises the error
    that says so and returns for any other; torch's own handle raises gloo's
    bare message."""

    __slots__ = ("work", "on_error", "op", "group")

    def __init__(self, work, on_error, op, group):
        self.work, self.on_error, self.op, self.group = work, on_error, op, group

    def wait(self):
        try:
            return self.work.wait()
        except RuntimeError as error:
            self.on_error(error, self.op, self.group)
            raise

    def is_completed(self) -> bool:
        return self.work.is_completed()


class AllOf:
    """The handle of several collectives: done when all are."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class StagedWork:
    """An async host-staged collective's handle: wait() waits for the
    collective on the host copies, then copies what it wrote back to the
    device tensors (`copies`: pairs of device tensor, host copy)."""

    __slots__ = ("work", "copies")

    def __init__(self, work, copies):
        self.work, self.copies = work, copies

    def wait(self):
        self.work.wait()
        copy_back(self.copies)
        self.copies = ()
        return True

    def is_completed(self) -> bool:
        # the copies back happen in wait(), which every caller makes
        return self.work.is_completed()


def copy_back(copies):
    for device_tensor, host in copies:
        device_tensor.copy_(host)

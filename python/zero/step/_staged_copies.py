"""The staged step's copies between the device and the host, pipelined
with the host update ([Note: staged step] in _step_path.py).

[Note: pipelined staged step]
- The partition is walked in chunks. Chunk i's gradients are copied into a
  page-locked window on a device-to-host stream while the C core updates
  chunk i-1, and chunk i-1's new parameters go back on a host-to-device
  stream while the C core updates chunk i: copies down, update and copies
  up are in flight at once, so a step takes about as long as the slowest
  of the three, not their sum. With the states in files (_nvme.py's
  paged_update), the disk's reads and writes of other chunks run beside
  them on the I/O engine's queue.
- Each side has SLOTS windows, used round robin. A gradient window is
  refilled only after the update that read it returned (the host does the
  update, so that is known without an event); a parameter window is
  rewritten only after the event recorded behind its last copy up has
  passed. The host waits on one event at a time, never on the whole
  device.
- The copies down start after the current stream's work (the reductions
  that wrote the gradients); the current stream waits for the last copy
  up before anything after the step (the all-gather, the next forward)
  reads the parameters.
- What is on the host already (a gradient partition or a shard kept
  there: [Note: parameters off the device] in offload/_param_staging.py)
  needs no window and no copy.
- On the CPU (tests) there are no streams: each copy is made at once,
  between separate buffers, in the same order of windows.
"""
from __future__ import annotations

import torch

from zero.sharding._flat_group import STAGING_SLOTS as SLOTS


class StagedCopies:
    def __init__(self, fg, ranges):
        """ranges: the chunks (lo, hi) the update walks, in order."""
        self.fg = fg
        self.ranges = ranges
        self.grad_windows = fg.host_windows.get("grad")
        self.out_windows = fg.host_windows.get("copy_out")
        self.cuda = fg.device.type == "cuda"
        self.sent = [None] * SLOTS    # per parameter window: the event of its last copy up
        self.fetched = [None] * SLOTS  # per gradient window: the event of its copy down
        if self.cuda:
            current = torch.cuda.current_stream(fg.device)
            self.down, self.up = _streams(fg.device)
            self.down.wait_stream(current)  # the gradients are reduced
        if self.grad_windows is not None and ranges:
            self._fetch(0)

    def _slot(self, windows, i):
        lo, hi = self.ranges[i]
        size = windows.numel() // SLOTS
        start = (i % SLOTS) * size
        return windows[start:start + hi - lo]

    def _fetch(self, i):
        lo, hi = self.ranges[i]
        window = self._slot(self.grad_windows, i)
        if not self.cuda:
            window.copy_(self.fg.grad_part[lo:hi])
            return
        with torch.cuda.stream(self.down):
            window.copy_(self.fg.grad_part[lo:hi], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.down)
        self.fetched[i % SLOTS] = event

    def grad(self, i):
        """Chunk i's gradients on the host, once there; the next chunk's
        copy down is started first."""
        if self.grad_windows is None:
            return None  # read in place: chunk_buffers takes fg.tensors["grad"]
        if i + 1 < len(self.ranges):
            self._fetch(i + 1)  # its window's last reader, chunk i+1-SLOTS, is done
        event = self.fetched[i % SLOTS]
        if event is not None:
            event.synchronize()
        return self._slot(self.grad_windows, i)

    def out(self, i):
        """The window chunk i's new parameters are written into, free."""
        if self.out_windows is None:
            return None  # written in place, into the host shard
        event = self.sent[i % SLOTS]
        if event is not None:
            event.synchronize()
        return self._slot(self.out_windows, i)

    def send(self, i, window):
        """Chunk i's new parameters to the device's partition."""
        lo, hi = self.ranges[i]
        if window is None:
            self.fg.drop_param_pages(slice(lo, hi))
            return
        if not self.cuda:
            self.fg.shard[lo:hi].copy_(window)
            return
        with torch.cuda.stream(self.up):
            self.fg.shard[lo:hi].copy_(window, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.up)
        self.sent[i % SLOTS] = event

    def finish(self):
        """What runs after the step on the current stream reads the
        parameters only once they are all up."""
        if self.cuda:
            torch.cuda.current_stream(self.fg.device).wait_stream(self.up)


_STREAMS = {}


def _streams(device):
    """One pair of copy streams per device, kept for the process: a
    stream is cheap to keep and costly to make every step."""
    if device not in _STREAMS:
        _STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _STREAMS[device]

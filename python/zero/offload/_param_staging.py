"""Stage 3's parameter shard kept off the model's device (offload_param
"cpu" or "nvme" for a model on a GPU: ZeRO-Infinity's parameter offload).

[Note: parameters off the device]
- Each rank's shard of the parameters lives in host memory (page-locked,
  so a copy runs at bus speed and does not block the host) or, for
  "nvme", in a file mapped into memory (_nvme.NvmeFiles). The device
  holds only the units gathered at the moment, the persistent ones, the
  buckets and the activations.
- Before a unit is gathered, this rank copies only its own chunk of it to
  the device, on a side stream, and the all-gather on the device reads
  that copy: every rank's link to the host carries 1/N of the unit
  (ZeRO-Infinity's bandwidth-centric partitioning), and the copy of a
  prefetched unit runs while the device computes. The gather is issued
  on the current stream after it has been told to wait for the copy
  (an event between streams: the host does not wait).
- Whatever writes the host shard (the step, a GatheredParameters
  write-back, a checkpoint load) first waits for the copy stream
  (FlatGroup.settle_copies), so no copy still reading a chunk sees it
  change; the copy's device buffer is marked as used by the current
  stream, so torch's allocator does not hand it out again before the
  gather read it.
- With offload_optimizer as well (the staged step), the gradient
  partition lives in host memory too: each bucket's reduced portion is
  copied there as it comes back, and the host step writes the new
  parameters straight into the host shard. Without it, the master and
  the states stay on the device, and the new parameters are copied from
  the device master into the host shard after each update.
- On the CPU (tests, tests/test_params_off_device.py) the "device" and the
  host are the same memory; the same code then makes every copy between
  separate buffers, so a run must equal in-memory stage 3 bit for bit.
"""
from __future__ import annotations

import torch


def params_off_device(device: torch.device, offload_param) -> bool:
    """Whether stage 3's shard lives in host memory or files apart from a
    model on `device` (tests/test_params_off_device.py makes this true for a
    CPU model, to run the copies on the CPU). A CPU model's shard is in
    host memory already: offload_param "nvme" then maps it from a file in
    place ([Note: shard on a disk] in _flat_group.py)."""
    return device.type != "cpu" and offload_param.device in ("cpu", "nvme")


def host_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer for a model on `device`: page-locked for a GPU (its
    copies then run at bus speed and off the host's critical path)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


class ShardCopier:
    """Copies this rank's chunks of a host shard to the device ahead of
    their gathers, on a stream of its own."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.bytes_copied = 0  # host to device since the last take_bytes()

    def to_device(self, host_chunk: torch.Tensor) -> torch.Tensor:
        """A copy of host_chunk on the device, ordered before whatever the
        current stream runs next (the gather that reads it)."""
        self.bytes_copied += host_chunk.nbytes
        if self.stream is None:
            # the CPU: a real copy into a buffer of its own, as on a GPU
            return host_chunk.clone(memory_format=torch.contiguous_format)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            copy = torch.empty(host_chunk.shape, dtype=host_chunk.dtype, device=self.device)
            copy.copy_(host_chunk, non_blocking=True)
        current.wait_stream(self.stream)
        # allocated on the side stream, read on the current one (and by the
        # collective, which torch orders after the current stream)
        copy.record_stream(current)
        return copy

    def synchronize(self):
        """Until every copy issued so far has read its host chunk: called
        before the host shard is written (the step, a GatheredParameters
        write-back, a checkpoint load)."""
        if self.stream is not None:
            self.stream.synchronize()

    def take_bytes(self) -> int:
        copied, self.bytes_copied = self.bytes_copied, 0
        return copied

"""The batches a pipeline schedule is given, checked before any stage
sends: torch's PipelineStage learns the shapes of its micro-batches on the
first step and keeps them, so a batch that does not split evenly, or a
later batch of another shape (the short last batch of an epoch), made
the stages send and receive tensors of different sizes: gloo aborted the
receiving process from C++ ("terminate called after throwing an instance
of 'gloo::EnforceNotMet'"), or the last stage failed on a loss of
mismatched shapes. Each stage checks what it holds (the first its inputs,
the last its target) with no collective: the job's other processes then
end with it under torchrun (middle stages hold no tensors to check).
Uneven micro-batches are refused on one stage too: each micro-batch's loss
is divided by their number, which is the batch's mean only when they are
equal. Shapes may change between steps there (nothing is sent)."""
from __future__ import annotations

import torch


class MicroBatchShapes:
    def __init__(self, n_microbatches: int, sends: bool):
        """sends: the schedule's stages send to each other (more than one)."""
        self.n, self.sends = n_microbatches, sends
        self.first = None   # {argument name: micro-batch shape} of the first step

    def check(self, args, kwargs):
        """args, kwargs: one schedule.step's (its target among the kwargs)."""
        given = {f"args[{i}]": a for i, a in enumerate(args)}
        given.update((f"{k}=", v) for k, v in kwargs.items())
        shapes = {}
        for name, value in given.items():
            if not torch.is_tensor(value):
                continue
            if value.dim() == 0 or value.shape[0] % self.n:
                raise ValueError(
                    f"pipeline schedule step: {name} has shape {tuple(value.shape)}, whose "
                    f"first dimension (the batch) does not split into {self.n} micro-batches "
                    "of equal size; torch's pipeline stages need equal micro-batches (drop "
                    "or pad a short last batch: DataLoader(drop_last=True))")
            shapes[name] = (value.shape[0] // self.n, *value.shape[1:])
        if self.first is None or not self.sends:
            self.first = shapes
            return
        for name, shape in shapes.items():
            was = self.first.get(name)
            if was is not None and was != shape:
                raise ValueError(
                    f"pipeline schedule step: {name} gives micro-batches of shape {shape}, "
                    f"the first step's were {was}; torch's pipeline stages keep the shapes "
                    "of their first step, so every batch must have the same shape (drop or "
                    "pad a short last batch, pad sequences to one length)")

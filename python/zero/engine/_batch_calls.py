"""DeepSpeed's whole-batch calls, under its names: train_batch and
eval_batch (DeepSpeed's PipelineEngine has them; scripts written for it
call them), set_dataloader and set_dataiterator. A mixin of Engine.

[Note: train_batch] One call runs gradient_accumulation_steps
micro-batches, each `next()` of the data iterator, through forward,
backward and step (so the update lands at the last), and returns the
mean of their losses, averaged over the data-parallel ranks too, as
DeepSpeed's returns its aggregated loss. A micro-batch is (inputs,
labels), the loss `module.loss_fn(outputs, labels)` as a DeepSpeed
PipelineModule computes it; a model without loss_fn must return its loss
(a scalar tensor). The iterator is data_iter, else the one
set_dataiterator / set_dataloader gave (a loader restarts when it runs
out, as DeepSpeed's RepeatingLoader does), else the dataloader that
deepspeed.initialize built from training_data."""
from __future__ import annotations

import torch


def _repeating(loader):
    """The loader's batches for ever: a new epoch when one ends."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("train_batch: the dataloader gives no batches")
        epoch += 1


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


class BatchCalls:
    _data_iterator = None

    def set_dataloader(self, loader):
        """train_batch() and eval_batch() draw from `loader`, restarting it
        (next epoch) when it runs out."""
        self._data_iterator = _repeating(loader)

    def set_dataiterator(self, iterator):
        """train_batch() and eval_batch() draw from `iterator` (next())."""
        self._data_iterator = iterator

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """[Note: train_batch]: one global batch, one update; its mean loss."""
        it = self._batches(data_iter, "train_batch")
        losses = []
        for _ in range(self.config.gradient_accumulation_steps):
            loss = self._micro_batch_loss(next(it), "train_batch")
            self.backward(loss)
            self.step()
            losses.append(loss.detach().float())
        return self._mean_over_ranks(losses)

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True):
        """The mean loss of gradient_accumulation_steps micro-batches, without
        gradients (the model in whatever train/eval mode it is in, as
        DeepSpeed's); with return_logits, (loss, the last micro-batch's
        outputs)."""
        it = self._batches(data_iter, "eval_batch")
        losses, outputs = [], None
        with torch.no_grad():
            for _ in range(self.config.gradient_accumulation_steps):
                inputs, labels = self._split(next(it))
                outputs = self._forward(inputs)
                if compute_loss:
                    losses.append(self._loss_of(outputs, labels, "eval_batch").float())
        loss = self._mean_over_ranks(losses) if compute_loss else None
        return (loss, outputs) if return_logits else loss

    def _batches(self, data_iter, call):
        if data_iter is not None:
            return data_iter
        if self._data_iterator is None:
            raise ValueError(f"{call}: no data; pass data_iter=iter(loader), or give the "
                             "engine a loader first (engine.set_dataloader(loader), or "
                             "deepspeed.initialize(training_data=...))")
        return self._data_iterator

    @staticmethod
    def _split(batch):
        if isinstance(batch, (list, tuple)) and len(batch) == 2:
            return batch[0], batch[1]
        return batch, None

    def _forward(self, inputs):
        inputs = _to(inputs, self.device)
        if isinstance(inputs, dict):
            return self(**inputs)
        return self(*inputs) if isinstance(inputs, (list, tuple)) else self(inputs)

    def _micro_batch_loss(self, batch, call):
        inputs, labels = self._split(batch)
        return self._loss_of(self._forward(inputs), labels, call)

    def _loss_of(self, outputs, labels, call):
        loss_fn = getattr(self.module, "loss_fn", None)
        if loss_fn is not None and labels is not None:
            return loss_fn(outputs, _to(labels, self.device))
        loss = getattr(outputs, "loss", outputs)  # a HuggingFace output carries its loss
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            return loss
        raise ValueError(f"{call}: the model gave {type(outputs).__name__} and has no "
                         "loss_fn; give the module a loss_fn(outputs, labels) (as a "
                         "DeepSpeed PipelineModule has) and batches of (inputs, labels), or "
                         "make the model return its loss")

    def _mean_over_ranks(self, losses) -> torch.Tensor:
        mean = torch.stack(losses).mean().to(torch.float64)
        total = self._comm.everyone.sum_scalar(float(mean))
        return torch.tensor(total / self._comm.dp_world, dtype=torch.float32)

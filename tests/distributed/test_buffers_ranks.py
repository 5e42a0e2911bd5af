"""Buffers at initialize on 2 gloo ranks: every rank takes rank 0's values,
also for a buffer that is not contiguous (the collective writes numel x
itemsize bytes from the data pointer, so it goes through a contiguous
copy), and a buffer whose elements share memory (an expanded tensor) is
refused by name on every rank instead of being overrun."""
import torch
from torch import nn

import harness
import zero


class WithBuffers(nn.Module):
    def __init__(self, rank, expanded):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("transposed", torch.arange(12.0).reshape(3, 4).t() + 100 * rank)
        if expanded:
            self.register_buffer("scale", torch.ones(1, 64).expand(4096, 64))

    def forward(self, x):
        return self.lin(x)


def _initialize(rank, world, expanded):
    torch.manual_seed(0)
    model = WithBuffers(rank, expanded)
    try:
        engine = zero.initialize(model, stage=2)
    except ValueError as error:
        return str(error)
    values = model.transposed.clone(), model.transposed.stride()
    engine.close()
    return values


def test_buffers_take_rank_zeros_values():
    for values, stride in harness.run(2, _initialize, False):
        assert stride == (1, 4)  # still the module's own (transposed) tensor
        assert torch.equal(values, torch.arange(12.0).reshape(3, 4).t())


def test_expanded_buffer_is_refused_on_every_rank():
    for message in harness.run(2, _initialize, True):
        assert "buffer 'scale' has elements that share memory" in message

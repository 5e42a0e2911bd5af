"""Stage 3 and a parameter written in place inside its own module's
forward (w.clamp_() under no_grad): the write lands in the gathered unit,
which the forward's end releases. With the unit released the forward is
refused there, naming the parameter, before anything trains on it (it
used to surface at the next gather, blamed on a write outside the
forward, after a step of gradients taken at other weights); kept
gathered, the write is taken in as torch keeps it."""
import copy

import pytest
import torch
from torch import nn

import zero


class ClampedLinear(nn.Linear):
    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.2, 0.2)
        return super().forward(x)


def model_pair():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), ClampedLinear(8, 4))
    return model, copy.deepcopy(model)


def test_a_write_in_a_released_units_forward_is_refused_and_dropped():
    model, _ = model_pair()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0)
    with pytest.raises(RuntimeError, match="parameter '2.weight' was written in place "
                                           "during a forward"):
        engine(torch.randn(4, 8))
    # dropped: the engine goes on from the values it had, and says the same
    # on the next forward (the write is made again)
    state = engine.full_state_dict()
    for name, value in before.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="written in place during a forward"):
        engine(torch.randn(4, 8))
    engine.close()


def test_a_write_in_a_kept_units_forward_trains_as_torch():
    model, reference = model_pair()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=10**6)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        opt.zero_grad()
        reference(x).pow(2).mean().backward()
        opt.step()
    state = engine.full_state_dict()
    engine.close()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7)

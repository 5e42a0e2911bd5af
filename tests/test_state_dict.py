"""State dicts: round trips, and loading torch.optim's into ours and back."""
import copy

import pytest
import torch

import zero
from conftest import max_rel_error


def train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


PAIRS = [("AdamW", dict(lr=1e-2)), ("Adam", dict(lr=1e-2, amsgrad=True)),
         ("SGD", dict(lr=0.1, momentum=0.9)), ("Adagrad", dict(lr=0.1))]


@pytest.mark.parametrize("name,kwargs", PAIRS)
def test_torch_state_dict_loads_into_ours_and_back(name, kwargs):
    a, b = make_model(), make_model()
    torch_opt = getattr(torch.optim, name)(a.parameters(), foreach=False, **kwargs)
    train(a, torch_opt, 5, seed=1)
    b.load_state_dict(a.state_dict())
    ours = getattr(zero.optim, name)(b.parameters(), **kwargs)
    ours.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    # both continue from the same point and must stay together
    train(a, torch_opt, 10, seed=2)
    train(b, ours, 10, seed=2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert max_rel_error(q, p) <= 1e-5
    # ours -> torch
    c = make_model()
    c.load_state_dict(b.state_dict())
    torch_again = getattr(torch.optim, name)(c.parameters(), foreach=False, **kwargs)
    # deep copies, as a save and load would make: state_dict() returns live
    # tensors (torch.optim's does too), and torch's load keeps them as they are
    torch_again.load_state_dict(copy.deepcopy(ours.state_dict()))
    train(b, ours, 5, seed=3)
    train(c, torch_again, 5, seed=3)
    for p, q in zip(b.parameters(), c.parameters()):
        assert max_rel_error(p, q) <= 1e-5


def test_round_trip_keeps_fp32_master_of_bf16_params():
    model = make_model().to(torch.bfloat16)
    opt = zero.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    other = make_model().to(torch.bfloat16)
    opt2 = zero.optim.AdamW(other.parameters(), lr=1e-2)
    opt2.load_state_dict(saved)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(opt.state[p]["master_param"], opt2.state[q]["master_param"])
        assert opt2.state[q]["exp_avg"].dtype == torch.float32
        assert torch.equal(p, q)


def test_mismatched_state_dict_is_rejected_by_name():
    opt = zero.optim.AdamW(make_model().parameters())
    other = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="param group 0 has 4 parameters"):
        opt.load_state_dict(other.state_dict())

"""The late parameter read of tests/test_stage3_models.py on 2 gloo ranks:
the gather that the read triggers in backward is a collective, so every
rank must issue it. Each rank trains on the same batch, so the result must
equal one process's plain torch run (1e-6, SGD)."""
import torch

import harness
import zero
from test_stage3_models import RELEASED, GatedNet, assert_matches, gated_inputs, pair


def _gated_on_ranks(rank, world, how):
    model, _ref = pair(GatedNet, how)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    for x, use in gated_inputs():
        engine.backward(engine(x, use).square().mean())  # the same batch on each rank
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def test_parameter_used_again_on_two_ranks():
    _model, ref = pair(GatedNet, "mul")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, use in gated_inputs():
        opt.zero_grad()
        ref(x, use).square().mean().backward()
        opt.step()
    for state in harness.run(2, _gated_on_ranks, "mul"):
        assert_matches(state, ref)


def _read_by_attribute_on_ranks(rank, world):
    """A tied output layer reads the embedding's weight by attribute with
    no registration ([Note: parameters read by attribute]): the gather
    the read triggers is a collective, at the same point on every rank."""
    from test_external_parameters import Net, batches
    torch.manual_seed(0)
    model = Net(register=False)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, **RELEASED)
    for ids in batches():  # the same batch on each rank
        engine.backward(engine(ids).float().logsumexp(-1).mean())
        engine.step()
    with torch.no_grad():
        evaluated = engine(batches()[0])
    state = engine.full_state_dict()
    engine.close()
    return state, evaluated


def test_a_parameter_read_by_attribute_on_two_ranks():
    from test_external_parameters import Net, batches
    torch.manual_seed(0)
    ref = Net(register=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for ids in batches():
        opt.zero_grad()
        ref(ids).float().logsumexp(-1).mean().backward()
        opt.step()
    with torch.no_grad():
        expected = ref(batches()[0])
    for state, evaluated in harness.run(2, _read_by_attribute_on_ranks):
        assert_matches(state, ref)
        torch.testing.assert_close(evaluated, expected, rtol=1e-6, atol=1e-6)

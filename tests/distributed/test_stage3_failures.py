"""Stage 3 on 2 gloo ranks when one rank's forward raises: that rank must
leave the pass without the end-of-pass comparison of gathers (a
collective its peer, still gathering, never joins: both waited for good),
so the error ends its process and the peer fails too, instead of a hang."""
import pytest

import harness


def one_rank_raises(rank, world):
    import torch
    from torch import nn
    import zero
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3))
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0)
    x = torch.randn(4, 6)
    engine.backward(engine(x).square().mean())
    engine.step()
    if rank == 0:
        def fail(_module, _args):
            raise ValueError("a bad batch on rank 0")
        model[2].register_forward_pre_hook(fail)
    engine(x)
    return "finished"


def test_an_error_on_one_rank_ends_both_instead_of_hanging():
    with pytest.raises(RuntimeError) as failure:
        harness.run(2, one_rank_raises, timeout=90)
    assert "a bad batch on rank 0" in str(failure.value)

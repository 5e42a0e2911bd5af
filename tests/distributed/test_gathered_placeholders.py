"""zero.GatheredParameters on a model built in zero.partitioned_init before
initialize ([Note: placeholders gathered] in
sharding/_gathered_placeholders.py), as HuggingFace's code does under
DeepSpeed's zero.Init (_init_weights, resize_token_embeddings): on 1 and
2 gloo ranks the block sees the parameters' real values (it read zeros),
a write under modifier_rank=0 reaches every rank's partition (it made
initialize refuse on rank 0 alone), and one without a modifier rank is
refused and dropped. Compared with the same construction without
partitioned_init."""
import pytest
import torch
from torch import nn

import harness
import zero


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _on_rank(rank, world, modifier):
    torch.manual_seed(0)  # the same random state on every rank, on entry
    with zero.partitioned_init():
        model = build()
    head = model[2]
    with zero.GatheredParameters([head.bias, head.weight], modifier_rank=modifier):
        seen = head.weight.detach().clone()
        if rank == 0:
            with torch.no_grad():
                head.weight.fill_(0.5)
                head.bias.zero_()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3)
    state = engine.full_state_dict()
    engine.close()
    return seen, state


def _refused_on_rank(rank, world):
    torch.manual_seed(0)  # the same random state on every rank, on entry
    with zero.partitioned_init():
        model = build()
    with pytest.raises(RuntimeError, match="written inside zero.GatheredParameters without "
                                           "modifier_rank"):
        with zero.GatheredParameters([model[2].weight]):
            with torch.no_grad():
                model[2].weight.fill_(0.5)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3)
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("world", [1, 2])
def test_a_block_before_initialize_reads_and_writes_the_real_values(world):
    plain = build()
    for seen, state in harness.run(world, _on_rank, 0):
        assert torch.equal(seen, plain[2].weight.detach())
        assert torch.equal(state["2.weight"], torch.full((4, 32), 0.5))
        assert torch.equal(state["2.bias"], torch.zeros(4))
        assert torch.equal(state["0.weight"], plain[0].weight.detach())


def test_a_write_without_a_modifier_rank_is_refused_and_dropped():
    plain = build()
    for state in harness.run(2, _refused_on_rank):
        for name, value in plain.state_dict().items():
            assert torch.equal(state[name], value), name


def _mixed_block_raises_on_rank_1(rank, world):
    """One block over an engine's parameter and a placeholder, raising on
    rank 1: every rank leaves with an error, none waits in the other's
    agreement (the rank that did not raise skipped the placeholders')."""
    torch.manual_seed(0)
    with zero.partitioned_init():
        built = build()
    trained = nn.Linear(4, 4)
    engine = zero.initialize(trained, optimizer=torch.optim.SGD(trained.parameters(), lr=0.1),
                             stage=3)
    try:
        with zero.GatheredParameters([trained.weight, built[2].weight], modifier_rank=0):
            if rank == 1:
                raise ValueError("rank 1's own error")
    except (ValueError, RuntimeError) as error:
        message = str(error)
    else:
        message = None
    engine.close()
    return message, tuple(built[2].weight.shape), built[2].weight.stride()


def test_a_mixed_block_that_raises_on_one_rank_ends_on_every_rank():
    results = harness.run(2, _mixed_block_raises_on_rank_1)
    assert "another rank raised" in results[0][0]
    assert results[1][0] == "rank 1's own error"
    for _message, shape, stride in results:  # the placeholder back on both
        assert shape == (4, 32) and stride == (0, 0)

"""engine.train_batch on 2 gloo ranks: the loss it returns is the mean of
every rank's micro-batch losses (DeepSpeed's aggregated loss), the same on
both ranks, and the update equals the user's loop on the same data."""
import torch
from torch import nn

import harness


def train(rank, world):
    import zero
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model.loss_fn = nn.MSELoss()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=2, gradient_accumulation_steps=2)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g))
               for _ in range(2)]
    with torch.no_grad():
        own = [model.loss_fn(engine(x), y).item() for x, y in batches]
    loss = engine.train_batch(iter(batches))
    state = engine.full_state_dict()
    engine.close()
    return loss.item(), own, state


def test_the_loss_is_the_mean_over_ranks():
    results = harness.run(2, train, timeout=120)
    every = [value for _loss, own, _state in results for value in own]
    for loss, _own, state in results:
        assert abs(loss - sum(every) / 4) <= 1e-6 * abs(loss)
    assert all(torch.equal(results[0][2][k], results[1][2][k]) for k in results[0][2])
    # the update: the mean gradient over the 4 micro-batches of both ranks
    torch.manual_seed(0)
    reference = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss = 0
    for rank in range(2):
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
            loss = loss + nn.functional.mse_loss(reference(x), y) / 4
    loss.backward()
    optimizer.step()
    for name, p in reference.named_parameters():
        assert torch.allclose(results[0][2][name], p.detach(), atol=1e-6), name

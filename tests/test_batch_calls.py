"""engine.train_batch / eval_batch / set_dataloader / set_dataiterator,
DeepSpeed's whole-batch calls ([Note: train_batch] in
python/zero/engine/_batch_calls.py): one train_batch equals the loop a
user writes (gradient_accumulation_steps micro-batches of forward,
backward, step), bit for bit, on a second engine built the same way; the
returned loss is the micro-batches' mean; the loader restarts when it runs
out; refusals name what to do. tests/distributed/test_batch_calls_ranks.py
checks the mean over 2 ranks."""
import pytest
import torch
from torch import nn

import zero
import zero.deepspeed as deepspeed
from engine_cases import no_launcher


class WithLoss(nn.Module):
    """A model with DeepSpeed PipelineModule's loss_fn."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
        self.loss_fn = nn.MSELoss()

    def forward(self, x):
        return self.body(x)


def data(n=10):
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g),
                                          torch.randn(n, 3, generator=g))


CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2}}


def engine_and_loader():
    torch.manual_seed(0)
    model = WithLoss()
    engine, _opt, loader, _sched = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=data(),
        config=CONFIG, dist_init_required=False)
    return engine, loader


@pytest.fixture
def one_process(monkeypatch):
    no_launcher(monkeypatch)


def test_train_batch_is_the_users_loop(one_process):
    ours, _ = engine_and_loader()
    theirs, loader = engine_and_loader()
    batches = iter(loader)
    for _ in range(2):
        losses = []
        for _ in range(2):
            x, y = next(batches)
            loss = theirs.module.loss_fn(theirs(x), y)
            theirs.backward(loss)
            theirs.step()
            losses.append(loss.item())
        got = ours.train_batch()  # from the loader initialize built
        assert got.item() == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert ours.global_steps == theirs.global_steps == 2
    for a, b in zip(ours.full_state_dict().values(), theirs.full_state_dict().values()):
        assert torch.equal(a, b)
    ours.close()
    theirs.close()


def test_the_loader_restarts_and_eval_changes_nothing(one_process):
    engine, loader = engine_and_loader()
    assert len(loader) == 5  # 10 samples, 2 a micro-batch: 2.5 calls an epoch
    for _ in range(4):
        engine.train_batch()
    assert engine.global_steps == 4
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.set_dataiterator(iter(loader))
    loss, outputs = engine.eval_batch(iter(loader), return_logits=True)
    assert loss.dim() == 0 and outputs.shape == (2, 3)
    x, y = list(loader)[1]
    with torch.no_grad():
        assert torch.allclose(outputs, engine(x))
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and engine.global_steps == 4
    engine.close()


def test_a_model_returning_its_loss_needs_no_loss_fn(one_process):
    class ReturnsLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x, y):
            return nn.functional.mse_loss(self.lin(x), y)

    torch.manual_seed(0)
    model = ReturnsLoss()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    loader = torch.utils.data.DataLoader(data(), batch_size=2)
    engine.set_dataloader([{"x": x, "y": y} for x, y in loader])  # keyword inputs
    loss = engine.train_batch()
    assert loss.item() > 0 and engine.global_steps == 1
    engine.close()


def test_refusals_say_what_to_do(one_process):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="set_dataloader"):
        engine.train_batch()
    engine.set_dataloader(torch.utils.data.DataLoader(data(), batch_size=2))
    with pytest.raises(ValueError, match="no loss_fn"):
        engine.train_batch()
    engine.set_dataloader([])
    with pytest.raises(ValueError, match="gives no batches"):
        engine.train_batch()
    engine.close()

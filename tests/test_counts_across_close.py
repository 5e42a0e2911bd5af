"""close() then a new zero.initialize with the same optimizer goes on bit
for bit as a run never closed ([Note: counts carried across close] in
engine/_carried_counts.py): the parameters and optimizer states came back
before, but the engine's own counts did not (determinism hunt): the fp16
dynamic loss scale started again at its initial value, a schedule built
from the config began its warm-up again, and global_steps restarted at 0,
so a save under the default tag replaced the real checkpoint of that step."""
import pytest
import torch
from torch import nn

import zero
from engine_cases import no_launcher


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    no_launcher(monkeypatch)


def config(precision):
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                        "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 8}}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


def run(precision, close_before=None, save_dir=None):
    """Six steps; with close_before=k, close() and a new initialize with the
    same optimizer before step k. Returns (the state, each step's loss
    scale, lr and global_steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = zero.initialize(model, optimizer=optimizer, config=config(precision))
    seen = []
    for k in range(6):
        if k == close_before:
            engine.close()
            engine = zero.initialize(model, optimizer=optimizer, config=config(precision))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        engine.backward(engine(x).float().square().mean() * 1e-3)
        engine.step()
        seen.append((engine.loss_scale, engine.get_lr()[0], engine.global_steps))
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    state = engine.full_state_dict()
    engine.close()
    return state, seen


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_close_and_initialize_again_go_on_as_one_run(precision, tmp_path):
    whole, seen_whole = run(precision)
    resumed, seen_resumed = run(precision, close_before=3, save_dir=tmp_path)
    assert seen_resumed == seen_whole
    assert [g for _s, _lr, g in seen_whole] == [1, 2, 3, 4, 5, 6]
    if precision == "fp16":
        assert len({s for s, _lr, _g in seen_whole}) > 1  # the dynamic scale moved
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), key
    assert (tmp_path / "global_step6").is_dir() and not (tmp_path / "global_step3").exists()


def test_a_new_optimizer_starts_the_counts_afresh():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    engine.close()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.global_steps == 0
    engine.close()


def test_a_static_loss_scale_is_not_carried_into_a_dynamic_engine():
    """A static scale is the config's, not a state to go on from (review)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    base = {"train_micro_batch_size_per_gpu": 2}
    engine = zero.initialize(model, optimizer=optimizer,
                             config={**base, "fp16": {"enabled": True, "loss_scale": 4}})
    engine.backward(engine(torch.randn(2, 4)).float().sum())
    engine.step()
    engine.close()
    engine = zero.initialize(model, optimizer=optimizer, config={
        **base, "fp16": {"enabled": True, "initial_scale_power": 16}})
    assert engine.loss_scale == 2.0 ** 16 and engine.global_steps == 1
    engine.close()


def test_warmup_to_the_groups_own_rate_goes_on_after_close():
    """WarmupLR without warmup_max_lr warms up to each group's own lr: built
    again after close(), it took the warmed-up rate of then for the peak and
    stayed at 61% of it for good (review)."""
    def lrs(close_before=None):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = {"train_micro_batch_size_per_gpu": 2,
               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 6}}}
        engine = zero.initialize(model, optimizer=optimizer, config=cfg)
        seen = []
        for k in range(8):
            if k == close_before:
                engine.close()
                engine = zero.initialize(model, optimizer=optimizer, config=cfg)
            engine.backward(engine(torch.randn(2, 4)).sum())
            engine.step()
            seen.append(engine.get_lr()[0])
        engine.close()
        return seen
    whole = lrs()
    assert whole[-1] == pytest.approx(0.1)
    assert lrs(close_before=3) == whole


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_close_between_an_updates_micro_batches_warns(stage):
    """A close() after 1 micro-batch of 2: the next initialize rounds the
    count up to a boundary, so that micro-batch's update is lost (5 updates
    of 12 micro-batches instead of 6, 7e-3 off an uninterrupted run, with
    no word: lifecycle hunt). It warns now; a close() at a boundary does
    not."""
    import warnings
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero.initialize(model, optimizer=optimizer, stage=stage,
                             gradient_accumulation_steps=2)
    engine.backward(engine(torch.randn(3, 4)).sum())
    engine.step()
    with pytest.warns(UserWarning, match=r"close\(\) between an update's micro-batches: the "
                                         r"gradients of 1 micro-batch\(es\) of 2 are not "
                                         "carried"):
        engine.close()
    engine = zero.initialize(model, optimizer=optimizer, stage=stage,
                             gradient_accumulation_steps=2)
    for _ in range(2):
        engine.backward(engine(torch.randn(3, 4)).sum())
        engine.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.close()

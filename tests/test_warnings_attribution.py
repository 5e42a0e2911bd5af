"""zero's warnings name the user's line (zero/_warnings.py): the same
warning is reached through zero.initialize, zero.deepspeed's initialize,
Config.from_deepspeed or torch's own state_dict recursion, each at another
depth; a fixed stacklevel pointed inside zero or torch, and Python's
default filters then hid a DeprecationWarning (logs hunt)."""
import warnings

import pytest
import torch
from torch import nn

import zero
import zero.deepspeed as deepspeed
from engine_cases import no_launcher

HERE = __file__


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    no_launcher(monkeypatch)


def caught_where(call, category):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    mine = [w for w in caught if issubclass(w.category, category)]
    assert mine, [str(w.message) for w in caught]
    return [w.filename for w in mine], result


def float64_model():
    return nn.Sequential(nn.Linear(4, 4).double(), nn.Linear(4, 2).double())


@pytest.mark.parametrize("route", ["zero", "deepspeed"])
def test_a_construction_warning_names_the_callers_line(route):
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model = float64_model()
    if route == "zero":
        files, engine = caught_where(lambda: zero.initialize(model, config=config),
                                     RuntimeWarning)
    else:
        files, (engine, *_) = caught_where(
            lambda: deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                         config=config, dist_init_required=False),
            RuntimeWarning)
    assert set(files) == {HERE}
    engine.close()


def test_a_deprecated_key_is_shown_by_the_default_filters():
    """A DeprecationWarning is shown by default only where __main__ (here:
    the test module, as filtered by pytest) triggers it."""
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 2, "cpu_offload": True}}
    files, cfg = caught_where(lambda: zero.Config.from_deepspeed(config), DeprecationWarning)
    assert set(files) == {HERE}
    assert cfg.offload_optimizer.device == "cpu"
    files, engine = caught_where(lambda: zero.initialize(nn.Linear(4, 2), config=config),
                                 DeprecationWarning)
    assert set(files) == {HERE}
    engine.close()


def test_a_state_dict_of_released_parameters_names_the_callers_line():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0)
    files, _ = caught_where(lambda: model.state_dict(), RuntimeWarning)
    assert set(files) == {HERE}
    engine.close()

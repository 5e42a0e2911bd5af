"""zero.deepspeed's small utilities DeepSpeed scripts import: OnDevice
(a model built on a device in a dtype: utils/_on_device.py),
RepeatingLoader (utils/_loaders.py), and the logger with log_dist
(utils/_logging.py), against what DeepSpeed 0.19.8's do."""
import io
import logging
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero.deepspeed as deepspeed
from zero.deepspeed import utils


def test_on_device_builds_on_the_device_in_the_dtype_and_puts_defaults_back():
    with deepspeed.OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = nn.Linear(4, 3)
        counts = torch.zeros(3, dtype=torch.int64)
        # as DeepSpeed's: empty/zeros/ones/full only, so a table computed in
        # __init__ (rotary frequencies) stays real, in its own dtype
        table = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        given = torch.tensor([1.0, 2.0])
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert counts.device.type == "meta" and counts.dtype == torch.int64  # integers keep theirs
    assert table.device.type == "cpu" and table.dtype == torch.float32
    assert given.device.type == "cpu" and given.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
    assert torch.empty(1).device.type == "cpu"
    with utils.OnDevice(dtype=torch.float16, device="meta", enabled=False):
        plain = nn.Linear(4, 3)
    assert plain.weight.device.type == "cpu" and plain.weight.dtype == torch.float32


def test_on_device_puts_defaults_back_after_an_error():
    with pytest.raises(KeyError):
        with deepspeed.OnDevice(dtype=torch.float64, device="meta"):
            raise KeyError("in the model's __init__")
    assert torch.get_default_dtype() == torch.float32
    assert torch.empty(1).device.type == "cpu"


def test_on_device_refuses_a_dtype_that_is_not_floating():
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        deepspeed.OnDevice(dtype=torch.int32)


def test_repeating_loader_starts_again_at_the_end():
    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2)
    got = [batch.tolist() for _, batch in zip(range(7), utils.RepeatingLoader(loader))]
    assert got == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4], [0, 1]]
    with pytest.raises(StopIteration):
        next(utils.RepeatingLoader([]))


@pytest.fixture
def logged():
    assert utils.logger.level == logging.WARNING  # DeepSpeed's: info says nothing by default
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    utils.logger.addHandler(handler)
    utils.logger.setLevel(logging.INFO)
    yield out
    utils.logger.setLevel(logging.WARNING)
    utils.logger.removeHandler(handler)


@pytest.fixture
def one_process_group():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}",
                                rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_log_dist_logs_everywhere_before_any_group(logged):
    deepspeed.log_dist("hello", ranks=[0])
    assert logged.getvalue() == "[Rank -1] hello\n"
    assert deepspeed.logger is utils.logger and not utils.logger.propagate


def test_log_dist_logs_on_the_listed_ranks(logged, one_process_group):
    utils.log_dist("none listed")
    utils.log_dist("others", ranks=[1, 2])
    utils.log_dist("mine", ranks=[1, 0])
    utils.log_dist("all", ranks=[-1], level=logging.WARNING)
    utils.log_dist("below the level", ranks=[0], level=logging.DEBUG)
    assert logged.getvalue() == "[Rank 0] mine\n[Rank 0] all\n"


@pytest.fixture
def own_handler_output(monkeypatch):
    """What the logger's own stdout handler prints, levels restored after."""
    handler, = [h for h in utils.logger.handlers if isinstance(h, logging.StreamHandler)]
    out = io.StringIO()
    monkeypatch.setattr(handler, "stream", out)
    yield out
    utils.set_log_level_from_string("warning")


def test_the_configs_log_level_sets_the_logger_and_its_handler(own_handler_output,
                                                               monkeypatch):
    """DeepSpeed's engine applies "log_level" to its logger and handlers;
    zero ignored the key, so a script's own logger.info lines never showed.
    The handler starts at WARNING as DeepSpeed's does: setLevel on the
    logger alone shows nothing more."""
    from engine_cases import no_launcher
    no_launcher(monkeypatch)
    utils.logger.setLevel(logging.INFO)
    utils.logger.info("logger alone")
    assert own_handler_output.getvalue() == ""
    model = nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 2, "log_level": "info",
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    # (dist_init_required=False: the engine's own group, left at destroy())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config, dist_init_required=False)
    assert utils.get_current_level() == logging.INFO
    utils.logger.info("after initialize")
    assert own_handler_output.getvalue().endswith("after initialize\n")
    engine.destroy()
    with pytest.raises(ValueError, match="log_level 'loud' is not one of"):
        deepspeed.initialize(model=model, model_parameters=model.parameters(),
                             config={**config, "log_level": "loud"}, dist_init_required=False)
    assert not dist.is_initialized()


def test_once_calls_log_each_message_once(logged):
    for _ in range(3):
        utils.log_dist_once("dist once", ranks=[0])
        utils.logger.warning_once("warned once")
        utils.logger.log_dist_once("dist once", ranks=[0])
    assert logged.getvalue() == "[Rank -1] dist once\nwarned once\n"

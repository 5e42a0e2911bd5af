"""zero.settings_that_fit: each row's bytes are estimate_memory's for that
setting (checked row by row against it, plus the rule for the buckets and
gathered units), and the fit decisions follow the limits: a model on the
meta device of 4.6B parameters needs offload on an 80 GB GPU at one rank,
and fits without it over 64."""
import pytest
import torch
from torch import nn

import zero
from engine_cases import no_launcher


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def blocks(width, depth):
    with torch.device("meta"):
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width),
                                             nn.Linear(4 * width, width))
                               for _ in range(depth)])


def test_rows_are_the_estimates_of_each_setting():
    model = blocks(256, 4)
    table = zero.settings_that_fit(model, 2, device_memory=2**30, host_memory=2**34,
                                   disk=2**40, precision="bf16")
    assert [(r["stage"], r["offload_optimizer"], r["offload_param"]) for r in table][:4] == \
        [(0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none")]
    assert len(table) == 4 + 3 + 3 + 3
    for row in table:
        options = {"offload_optimizer": {"device": row["offload_optimizer"],
                                         "nvme_path": "x"},
                   "offload_param": {"device": row["offload_param"], "nvme_path": "x"}}
        summary = zero.estimate_memory(model, 2, stage=row["stage"], precision="bf16",
                                       device="cuda", **options)
        states = summary["params"] + summary["grads"] + summary["optimizer_states"] + \
            summary["frozen_params"]
        assert row["device"] >= states  # plus the run's buckets and gathered units
        assert row["host"] == summary["host"]
        assert row["disk"] == summary["offloaded"] + summary["params_offloaded"]
    # more offloaded, less on the device
    by_setting = {(r["stage"], r["offload_optimizer"], r["offload_param"]): r for r in table}
    assert by_setting[(3, "cpu", "cpu")]["device"] < by_setting[(3, "cpu", "none")]["device"] \
        < by_setting[(3, "none", "none")]["device"]
    assert by_setting[(3, "nvme", "nvme")]["host"] < by_setting[(3, "cpu", "cpu")]["host"]
    assert "stage" in str(table) and str(table).count("\n") == len(table)


def test_a_4b_model_on_80gb_gpus():
    model = blocks(4096, 32)  # 32 blocks of 134M
    model.append(nn.Linear(4096, 4096 * 16, device="meta"))  # 4.6B in all
    numel = sum(p.numel() for p in model.parameters())
    assert 4e9 < numel < 8e9
    alone = zero.settings_that_fit(model, 1, device_memory=80e9, host_memory=1e12,
                                   disk=4e12, precision="bf16")
    assert alone.best is not None and alone.best["offload_optimizer"] != "none"
    assert all(not r["fits"] for r in alone if r["offload_optimizer"] == "none")
    many = zero.settings_that_fit(model, 64, device_memory=80e9, host_memory=1e12,
                                  precision="bf16")
    assert many.best["offload_optimizer"] == "none"
    # no disk: no nvme setting fits
    assert all(not r["fits"] for r in many if "nvme" in (r["offload_optimizer"],
                                                          r["offload_param"]))
    # too little host memory for the states: only the disk helps
    tight = zero.settings_that_fit(model, 1, device_memory=80e9, host_memory=40e9,
                                   disk=4e12, precision="bf16")
    assert tight.best["offload_optimizer"] == "nvme"


class FourLinears(nn.Module):
    """A block of several Linears: stage 3 gathers the block, not one Linear."""
    def __init__(self, width):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("prefetch", [0, 4000])
def test_the_stage3_row_covers_what_a_run_gathers(prefetch):
    """The rule counted the largest module's own parameters as the running
    unit; the engine gathers whole blocks (units="block"), so the row fell
    short by the rest of a block. Run on the CPU (host memory is
    everything): the row is at least the run's states, buckets and
    gathered peak."""
    torch.manual_seed(0)
    model = nn.Sequential(*[FourLinears(32) for _ in range(4)])
    options = {"stage3_prefetch_bucket_size": prefetch, "reduce_bucket_size": 500,
               "stage3_param_persistence_threshold": 0}
    table = zero.settings_that_fit(model, 1, device_memory=0, host_memory=2**30, device="cpu",
                                   **options)
    row = next(r for r in table if (r["stage"], r["offload_optimizer"], r["offload_param"]) ==
               (3, "none", "none"))
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             **options)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 32)).square().mean())
        engine.step()
    summary = engine.memory_summary()
    engine.close()
    assert summary["gathered_peak"] >= 4 * (4 * 32 * 32)  # a block at least, fp32
    assert row["host"] >= summary["model_states"] + summary["buckets"]


def test_the_stage3_row_covers_the_buckets_of_tiny_units():
    """Small units share a bucket with their padding ([Note: small units
    share a bucket] in csrc/zero.h): 500 Linear(4, 4) units hold 20
    parameters each but 80 laid-out elements, so the rule's buckets, capped
    by the parameters' count, fell short of the run's 4x over."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(500)])
    options = {"units": "module"}
    table = zero.settings_that_fit(model, 1, device_memory=0, host_memory=2**30, device="cpu",
                                   **options)
    row = next(r for r in table if (r["stage"], r["offload_optimizer"], r["offload_param"]) ==
               (3, "none", "none"))
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             **options)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    summary = engine.memory_summary()
    engine.close()
    assert summary["buckets"] >= 500 * 80 * 4  # every unit's padded layout, fp32
    assert row["host"] >= summary["model_states"] + summary["buckets"]


def test_the_cpu_counts_everything_as_host_memory():
    model = blocks(256, 2)
    table = zero.settings_that_fit(model, 1, device_memory=0, host_memory=2**30,
                                   device="cpu")
    assert all(r["device"] == 0 for r in table)
    assert table.best == table[0]


@pytest.mark.parametrize("bad,match", [
    ({"stage": 2}, "tries every stage"),
    ({"offload_param": {"device": "cpu"}}, "leave offload_param out"),
    ({"device_memory": -1}, "device_memory must be a number of bytes"),
    ({"host_memory": "lots"}, "host_memory must be a number of bytes"),
    ({"headroom": 1.5}, "headroom must be a fraction"),
    ({"local_ranks": 0}, "local_ranks must be an integer"),
    ({"local_ranks": 2}, "local_ranks is 2 but world_size is 1"),
])
def test_bad_arguments_name_what_is_wrong(bad, match):
    arguments = {"device_memory": 2**30, "host_memory": 2**30, **bad}
    with pytest.raises(ValueError, match=match):
        zero.settings_that_fit(blocks(64, 1), 1, **arguments)


@pytest.mark.parametrize("arguments, message", [
    ({"world_size": 0}, "world_size must be an integer >= 1, got 0"),
    ({"world_size": "2"}, "world_size must be an integer >= 1"),
    ({"headroom": "0.1"}, "headroom must be a fraction"),
    ({"device_memory": float("nan")}, "device_memory must be a number of bytes"),
    ({"disk": float("nan")}, "disk must be a number of bytes")])
def test_arguments_are_checked_by_name(arguments, message):
    """Before: world_size 0 blamed local_ranks, a string compared with an
    int inside, NaN memory made a table where nothing fits."""
    given = {"device_memory": 2**30, "host_memory": 2**30, **arguments}
    with pytest.raises(ValueError, match=message):
        zero.settings_that_fit(nn.Linear(4, 2), **given)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got NoneType"):
        zero.settings_that_fit(None, device_memory=1, host_memory=1)

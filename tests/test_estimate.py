"""zero.estimate_memory against what the engine then reports: for every
stage, precision, optimizer and option that changes the layout, the
estimate equals memory_summary() of the engine built with the same
arguments, after a training step, byte for byte (no tolerance: both count
the same layout, one from sizes, one from the tensors). Run on 2 and 3
ranks in tests/distributed/test_estimate_ranks.py."""
import math

import pytest
import torch
from torch import nn

import zero
from engine_cases import Net, batches, loss_of, make_optimizer, no_launcher

EXACT = ["params", "grads", "optimizer_states", "offloaded", "persistent", "frozen_params",
         "trainable_params", "params_offloaded"]
RUN_DECIDES = " + gathered"  # stage 3's formula ends with the run's gathered bytes


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def frozen_net():
    torch.manual_seed(0)
    model = Net()
    model.body[0].requires_grad_(False)  # a frozen layer: its own group at stage 3
    return model


def measured(model, optimizer, **options):
    engine = zero.initialize(model, optimizer=optimizer, **options)
    for tokens, targets in batches("cpu", 1):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    summary = engine.memory_summary()
    engine.close()
    return summary


def check(estimate, summary):
    for key in EXACT:
        assert estimate[key] == summary[key], (key, estimate[key], summary[key])
    if summary["stage"] < 3:
        assert estimate["formula"] == summary["formula"]
        assert estimate["formula_bytes"] == summary["formula_bytes"]
    else:  # up to the gathered bytes, which only the run knows
        assert estimate["formula"].split(RUN_DECIDES)[0] == \
            summary["formula"].split(RUN_DECIDES)[0]
    if summary["stage"] < 2:  # no buckets
        assert estimate["buckets"] == summary["buckets"] == 0
    else:
        assert estimate["buckets"] is None
    assert estimate["model_states"] == summary["model_states"] - summary["gathered_peak"]


CASES = [
    dict(precision="bf16"),
    dict(precision="fp16"),
    dict(precision="fp32"),
    dict(precision="bf16", grad_accum_dtype="fp32"),
    dict(precision="bf16", stage3_param_persistence_threshold=2000),
    # exactly the last body Linear's unit at one rank (544 elements, laid
    # out as 592): a unit at the threshold persists
    dict(precision="bf16", stage3_param_persistence_threshold=592),
    # at most 1500 elements persistent in all: the first units that fit
    dict(precision="bf16", stage3_param_persistence_threshold=2000,
         stage3_model_persistence_threshold=1500),
]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
@pytest.mark.parametrize("optimizer", ["adamw", "adam_amsgrad", "sgd", "sgd_nesterov",
                                       "adagrad", "lion"])
def test_estimate_equals_the_engines_summary(stage, options, optimizer):
    model = frozen_net()
    params = [p for p in model.parameters() if p.requires_grad]
    estimate = zero.estimate_memory(model, 1, optimizer=make_optimizer(optimizer, params),
                                    stage=stage, **options)
    assert estimate["estimate"] is True
    check(estimate, measured(model, make_optimizer(optimizer, params), stage=stage, **options))


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("chunk", [1024, 2048, 1 << 20])  # 3, 2 and 1 windows a file
def test_offloaded_estimate(tmp_path, stage, chunk):
    offload = {"device": "nvme", "nvme_path": str(tmp_path), "chunk_elements": chunk}
    model = frozen_net()
    params = [p for p in model.parameters() if p.requires_grad]
    estimate = zero.estimate_memory(model, 1, optimizer=make_optimizer("adamw", params),
                                    stage=stage, precision="bf16", offload_optimizer=offload)
    assert estimate["offloaded"] > 0
    check(estimate, measured(model, make_optimizer("adamw", params), stage=stage,
                             precision="bf16", offload_optimizer=offload))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("with_optimizer", [False, True], ids=["params", "params+optimizer"])
def test_offloaded_parameters_estimate(tmp_path, precision, with_optimizer):
    """offload_param "nvme": the shard (the frozen group's too) in files,
    the persistent units in memory."""
    options = dict(stage=3, precision=precision, stage3_param_persistence_threshold=592,
                   offload_param={"device": "nvme", "nvme_path": str(tmp_path)})
    if with_optimizer:
        options["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path),
                                        "chunk_elements": 1024}
    model = frozen_net()
    params = [p for p in model.parameters() if p.requires_grad]
    estimate = zero.estimate_memory(model, 1, optimizer=make_optimizer("adamw", params),
                                    **options)
    assert estimate["params_offloaded"] > 0 and estimate["persistent"] > 0
    assert estimate["params"] == estimate["persistent"]
    summary = measured(model, make_optimizer("adamw", params), **options)
    check(estimate, summary)
    assert "parameter shard" in summary["formula"] and "params_offloaded" in str(summary)


def test_param_groups_and_a_deepspeed_config():
    """Groups with different states (momentum in one SGD group only; amsgrad
    in one Adam group only, at stage 3's units); the default optimizer
    comes from the config's block, as in initialize."""
    model = frozen_net()
    config = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    estimate = zero.estimate_memory(model, 1, config=config)
    check(estimate, measured(model, None, config=config))
    groups = [{"params": [model.embed.weight], "momentum": 0.0},
              {"params": [p for n, p in model.named_parameters()
                          if p.requires_grad and n != "embed.weight"], "momentum": 0.9}]
    estimate = zero.estimate_memory(model, 1, optimizer=torch.optim.SGD(groups, lr=0.1),
                                    stage=1)
    check(estimate, measured(model, torch.optim.SGD(groups, lr=0.1), stage=1))

    def adam():
        return torch.optim.Adam(
            [{"params": [model.embed.weight, model.head.bias], "amsgrad": True},
             {"params": [p for n, p in model.named_parameters()
                         if p.requires_grad and n not in ("embed.weight", "head.bias")]}])
    estimate = zero.estimate_memory(model, 1, optimizer=adam(), stage=3, precision="bf16")
    check(estimate, measured(model, adam(), stage=3, precision="bf16"))


def test_a_meta_model_is_sized_without_memory():
    """Built on the meta device, as one would size a model that fits
    nowhere yet: the same figures as the real one, at any world size."""
    with torch.device("meta"):
        meta = frozen_net()
    real = frozen_net()
    for world in (1, 8, 1024):
        for stage in (0, 1, 2, 3):
            a = zero.estimate_memory(meta, world, stage=stage, precision="bf16")
            b = zero.estimate_memory(real, world, stage=stage, precision="bf16")
            assert dict(a) == dict(b)
    # a 7B-sized model: 32 layers of 4096^2 x 12 parameters, never allocated
    with torch.device("meta"):
        big = nn.Sequential(*[nn.Linear(4096, 4096 * 12, bias=False) for _ in range(32)])
    estimate = zero.estimate_memory(big, 64, stage=3, precision="bf16")
    psi = 32 * 4096 * 4096 * 12
    assert estimate["trainable_params"] == psi
    # 16Ψ/N: bf16 params and grads, fp32 master and two moments
    assert estimate["model_states"] == pytest.approx(16 * psi / 64, rel=1e-6)
    assert "stage 3: (2+2+12)Ψ/N" in estimate["formula"]
    # a config's optimizer that zero.optim builds (Lion: 1 state) was refused
    # on meta parameters
    lion = zero.estimate_memory(big, 64, stage=3, precision="bf16",
                                config={"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})
    assert lion["model_states"] == pytest.approx(12 * psi / 64, rel=1e-6)


def test_a_model_an_engine_trains_is_refused():
    model = Net()
    engine = zero.initialize(model, stage=3, stage3_param_persistence_threshold=0)
    with pytest.raises(ValueError, match="already trained by an engine: its memory_summary"):
        zero.estimate_memory(model, 1, stage=3)
    engine.close()
    assert zero.estimate_memory(Net(), 1)["trainable_params"] > 0


def test_bad_arguments_are_named():
    model = Net()
    for bad in ("gpu", "mps", 2.5):
        with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got"):
            zero.estimate_memory(model, 2, device=bad)
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="world_size must be an integer >= 1, got "):
            zero.estimate_memory(model, bad)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        zero.estimate_memory(torch.zeros(3), 2)
    with pytest.raises(TypeError, match="RMSprop cannot be partitioned"):
        zero.estimate_memory(model, 2, optimizer=torch.optim.RMSprop(model.parameters()))
    with pytest.raises(TypeError, match="unknown option"):
        zero.estimate_memory(model, 2, bucket=3)
    frozen = Net().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zero.estimate_memory(frozen, 2, optimizer=torch.optim.SGD(frozen.parameters(), lr=0.1))


def test_str_is_the_summary_table():
    text = str(zero.estimate_memory(Net(), 4, stage=3, precision="bf16"))
    assert "optimizer_states" in text and "formula" in text
    assert "gathered_peak" not in text  # only a run knows it


def test_a_mesh_shape_counts_its_shard_dimension():
    """A rank of a (dp_replicate, dp_shard) mesh holds 1/dp_shard of what is
    partitioned, as on dp_shard ranks alone; the 4-rank measurement beside
    the engine is tests/distributed/test_mesh_groups.py."""
    model = frozen_net()
    for stage in (1, 3):
        alone = zero.estimate_memory(model, 3, stage=stage)
        for mesh in ((2, 3), [2, 3]):
            assert dict(zero.estimate_memory(model, stage=stage, mesh=mesh)) == dict(alone)
        assert dict(zero.estimate_memory(model, 6, stage=stage, mesh=(2, 3))) == dict(alone)
        assert dict(zero.estimate_memory(model, stage=stage, mesh=3)) == dict(alone)
    with pytest.raises(ValueError, match="world_size 4 differs from the mesh's 6 ranks"):
        zero.estimate_memory(model, 4, mesh=(2, 3))
    for bad in ((2, 0), (1, 2, 3), "2x3", (2.0, 3)):
        with pytest.raises(ValueError, match="mesh must be"):
            zero.estimate_memory(model, mesh=bad)


def test_a_mesh_of_model_parallelism_alone_partitions_nothing():
    """A 1-D DeviceMesh named tp or pp gives each rank a data-parallel group
    of its own (initialize reads it so: parallel/_mesh.py), so the estimate
    is one rank's. (A stand-in with DeviceMesh's attributes: this test runs no group.)"""
    from types import SimpleNamespace

    def mesh_of(names, shape):
        ranks = torch.arange(math.prod(shape)).reshape(shape)
        return SimpleNamespace(mesh=ranks, ndim=len(shape), mesh_dim_names=names,
                               size=lambda: ranks.numel())
    model = frozen_net()
    for stage in (1, 3):
        alone = dict(zero.estimate_memory(model, 1, stage=stage))
        for names in (("pp",), ("tp",)):
            assert dict(zero.estimate_memory(model, stage=stage,
                                             mesh=mesh_of(names, (4,)))) == alone


def test_the_model_persistence_threshold_caps_the_persistent_elements():
    """stage3_model_persistence_threshold (DeepSpeed's key): units under the
    per-unit threshold persist in layout order while their elements add up
    to at most the cap ([Note: persistence] in sharding/_units.py)."""
    torch.manual_seed(0)
    engine = zero.initialize(Net(), stage=3, stage3_param_persistence_threshold=2000,
                             stage3_model_persistence_threshold=1500, units="module")
    units = [u for fg in engine.all_groups for u in fg.units]
    numels = [u.numel for u in units]
    assert numels == [800, 561, 66, 544, 850]  # embed, body.0, body.2, body.3, head
    assert [u.persistent for u in units] == [True, True, True, False, False]
    assert sum(n for n, u in zip(numels, units) if u.persistent) <= 1500
    engine.close()

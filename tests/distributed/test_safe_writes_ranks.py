"""deepspeed.utils.safe_set_full_fp32_param and its companions
(deepspeed/utils/_safe_writes.py) on 1 and 2 gloo ranks, stages 0-3 (stage
3 with every unit released and with units kept gathered; states on the
host, states and parameters in files): a weight and
an AdamW state set after a step, then two more steps, equal plain torch
doing the same writes (fp32); the forward right after the write already
computes with the new weight ([Note: safe writes]); the local writers,
given f(local piece) on each rank, equal torch with f applied whole. In
bf16 the fp32 master keeps the written value exactly and the model's copy
holds it rounded."""
import pytest
import torch
from torch import nn

import harness
from test_safe_access_ranks import batches, build

STAGES = [(0, {}), (1, {}), (2, {}), (3, {"stage3_param_persistence_threshold": 0}),
          (3, {}), (2, {"offload_optimizer": "cpu"}),
          # states and parameters in files (the nvme path is filled in per run)
          (3, {"stage3_param_persistence_threshold": 0, "offload_optimizer": "nvme",
               "offload_param": "nvme"})]


def new_values():
    g = torch.Generator().manual_seed(5)
    return torch.randn(10, 6, generator=g), torch.randn(3, generator=g).abs() * 1e-3


def _on_rank(rank, world, directory):
    return {i: _trained(stage, options, directory) for i, (stage, options) in enumerate(STAGES)}


def _trained(stage, options, directory):
    import zero
    from zero.deepspeed import utils
    options = {key: {"device": value, "nvme_path": directory} if value == "nvme" else
               {"device": value} if key.startswith("offload") else value
               for key, value in options.items()}
    model = build()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=stage, **options)
    weight, avg = new_values()
    xs = batches()
    engine.backward(engine(xs[0]).square().mean())
    engine.step()
    utils.safe_set_full_fp32_param(model[0].weight, weight)
    utils.safe_set_full_optimizer_state(model[2].bias, avg, "exp_avg")
    # the local writers: f(piece) on each rank is f(whole) laid out
    piece = utils.safe_get_local_fp32_param(model[2].weight)
    utils.safe_set_local_fp32_param(model[2].weight, piece * 2 + 1)
    sq = utils.safe_get_local_optimizer_state(model[0].bias, "exp_avg_sq")
    utils.safe_set_local_optimizer_state(model[0].bias, sq * 3, "exp_avg_sq")
    with torch.no_grad():
        first_layer = engine(xs[1])  # before any step: the set weight is in use
    for x in xs[1:]:
        engine.backward(engine(x).square().mean())
        engine.step()
    got = {name: (utils.safe_get_full_fp32_param(p),
                  utils.safe_get_full_optimizer_state(p, "exp_avg"),
                  utils.safe_get_full_optimizer_state(p, "exp_avg_sq"))
           for name, p in model.named_parameters()}
    engine.close()
    return first_layer, got


def reference():
    """torch doing the same writes between its first and second steps."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    xs = batches()
    weight, avg = new_values()
    forwards = []
    for i, x in enumerate(xs):
        if i == 1:
            with torch.no_grad():
                model[0].weight.copy_(weight)
                opt.state[model[2].bias]["exp_avg"].copy_(avg)
                model[2].weight.mul_(2).add_(1)
                opt.state[model[0].bias]["exp_avg_sq"].mul_(3)
                forwards.append(model(x))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt, forwards[0]


@pytest.mark.parametrize("world", [1, 2])
def test_set_values_train_as_torchs(world, tmp_path):
    model, opt, forward = reference()
    for answers in harness.run(world, _on_rank, str(tmp_path)):
        for i, (first_layer, got) in answers.items():
            where = f"stage {STAGES[i]}"
            torch.testing.assert_close(first_layer, forward, rtol=1e-5, atol=1e-6, msg=where)
            for name, p in model.named_parameters():
                full, avg, avg_sq = got[name]
                torch.testing.assert_close(full, p.detach(), rtol=1e-5, atol=1e-6, msg=where)
                torch.testing.assert_close(avg, opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-7,
                                           msg=where)
                torch.testing.assert_close(avg_sq, opt.state[p]["exp_avg_sq"], rtol=1e-5,
                                           atol=1e-9, msg=where)


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_master_exact_model_copy_rounded(stage):
    import zero
    from zero.deepspeed import utils
    model = build()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=stage, precision="bf16")
    weight, _avg = new_values()
    utils.safe_set_full_fp32_param(model[0].weight, weight)
    assert torch.equal(utils.safe_get_full_fp32_param(model[0].weight), weight)
    with zero.GatheredParameters([model[0].weight]):
        assert torch.equal(model[0].weight.detach(), weight.to(torch.bfloat16))
    # the next step starts from the written master, not from its rounding
    x = batches()[0]
    engine.backward(engine(x).float().square().mean())
    engine.step()
    moved = utils.safe_get_full_fp32_param(model[0].weight) - weight
    assert 0 < moved.abs().max() < 0.02  # one AdamW step of lr 1e-2
    engine.close()


def test_bad_values_refused_and_nothing_written():
    import zero
    from zero.deepspeed import utils
    model = build()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=2)
    before = utils.safe_get_full_fp32_param(model[0].weight)
    with pytest.raises(ValueError, match="value has 6 elements .* the parameter has 60"):
        utils.safe_set_full_fp32_param(model[0].weight, torch.zeros(6))
    with pytest.raises(TypeError, match="value must be a torch.Tensor"):
        utils.safe_set_full_fp32_param(model[0].weight, [0.0] * 60)
    with pytest.raises(ValueError, match="this rank holds 60"):
        utils.safe_set_local_fp32_param(model[0].weight, torch.zeros(61))
    with pytest.raises(RuntimeError, match="no state 'exp_avg' before its first update"):
        utils.safe_set_full_optimizer_state(model[0].weight, torch.zeros(10, 6), "exp_avg")
    engine.backward(engine(batches()[0]).square().mean())
    engine.step()
    with pytest.raises(KeyError, match="momentum_buffer"):
        utils.safe_set_local_optimizer_state(model[0].weight, torch.zeros(60), "momentum_buffer")
    assert not torch.equal(utils.safe_get_full_fp32_param(model[0].weight), before)  # stepped
    engine.close()
    # a parameter no engine trains: left alone, as DeepSpeed leaves a frozen one
    p = nn.Parameter(torch.zeros(2))
    utils.safe_set_full_fp32_param(p, torch.ones(2))
    assert torch.equal(p.detach(), torch.zeros(2))


def _one_rank_refuses(rank, world):
    """Rank 1 passes a value of the wrong size: every rank raises (no rank
    waits in a collective the other left, none writes while the other
    does not), and the engine trains on."""
    import zero
    from zero.deepspeed import utils
    model = build()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=2)
    x = batches()[0]
    engine.backward(engine(x).square().mean())
    engine.step()
    before = utils.safe_get_full_fp32_param(model[0].weight)
    said = []
    bad = 1 if rank == 1 else 0
    for call in (lambda: utils.safe_set_full_fp32_param(model[0].weight,
                                                         torch.ones(60 - bad)),
                 lambda: utils.safe_set_local_fp32_param(
                     model[0].weight, torch.ones(utils.safe_get_local_fp32_param(
                         model[0].weight).numel() + bad)),
                 lambda: utils.safe_set_full_grad(model[0].weight, torch.ones(60 - bad))):
        try:
            call()
            said.append(None)
        except (ValueError, RuntimeError) as error:
            said.append(str(error))
    unchanged = torch.equal(utils.safe_get_full_fp32_param(model[0].weight), before)
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.close()
    return said, unchanged


def test_a_value_refused_on_one_rank_is_refused_on_every_rank():
    (mine, mine_unchanged), (theirs, theirs_unchanged) = harness.run(2, _one_rank_refuses,
                                                                     timeout=120)
    assert mine_unchanged and theirs_unchanged
    for said in mine:
        assert said is not None and "another rank refused" in said, mine
    for said in theirs:
        assert said is not None and "value has" in said, theirs

"""deepspeed.utils.safe_get_full_fp32_param and its companions
(deepspeed/utils/_safe_access.py) on 1 and 2 gloo ranks, stages 1-3:
the whole fp32 values and AdamW states of each parameter equal plain
torch's after the same steps (fp32, each rank on the same batches), the
local pieces laid end to end in rank order are the whole, and states
are None before the first update, as DeepSpeed's."""
import pytest
import torch
from torch import nn

import harness


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def batches():
    g = torch.Generator().manual_seed(2)
    return [torch.randn(4, 6, generator=g) for _ in range(3)]


def _on_rank(rank, world):
    return {stage: _trained(stage) for stage in (1, 2, 3)}  # one launch: seconds each


def _trained(stage):
    import zero
    from zero.deepspeed import utils
    model = build()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=stage, stage3_param_persistence_threshold=0)
    before = utils.safe_get_full_optimizer_state(model[0].weight, "exp_avg")
    for x in batches():
        engine.backward(engine(x).square().mean())
        engine.step()
    got = {}
    for name, p in model.named_parameters():
        got[name] = (utils.safe_get_full_fp32_param(p),
                     utils.safe_get_full_optimizer_state(p, "exp_avg"),
                     utils.safe_get_full_optimizer_state(p, "exp_avg_sq"),
                     utils.safe_get_local_fp32_param(p),
                     utils.safe_get_local_optimizer_state(p, "exp_avg"))
    with pytest.raises(KeyError, match="momentum_buffer"):
        utils.safe_get_full_optimizer_state(model[0].weight, "momentum_buffer")
    engine.close()
    return before, got


@pytest.mark.parametrize("world", [1, 2])
def test_full_and_local_values_equal_torchs(world):
    reference = build()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x in batches():
        opt.zero_grad()
        reference(x).square().mean().backward()
        opt.step()
    for results in _by_stage(harness.run(world, _on_rank)).values():
        _check(reference, opt, results)


def _by_stage(ranks):
    return {stage: [answer[stage] for answer in ranks] for stage in ranks[0]}


def _check(reference, opt, results):
    for before, got in results:
        assert before is None
        for name, p in reference.named_parameters():
            full, avg, avg_sq, _local, _local_avg = got[name]
            torch.testing.assert_close(full, p.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(avg, opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(avg_sq, opt.state[p]["exp_avg_sq"], rtol=1e-5,
                                       atol=1e-9)
    for name, p in reference.named_parameters():
        pieces = torch.cat([got[name][3] for _before, got in results])
        avg_pieces = torch.cat([got[name][4] for _before, got in results])
        torch.testing.assert_close(pieces, results[0][1][name][0].reshape(-1))
        torch.testing.assert_close(avg_pieces, results[0][1][name][1].reshape(-1))


def test_a_parameter_no_engine_trains_gives_none():
    from zero.deepspeed import utils
    p = nn.Parameter(torch.zeros(2))
    assert utils.safe_get_full_fp32_param(p) is None
    assert utils.safe_get_local_optimizer_state(p, "exp_avg") is None
    with pytest.raises(TypeError, match="param must be a torch.nn.Parameter"):
        utils.safe_get_full_fp32_param(torch.zeros(2))

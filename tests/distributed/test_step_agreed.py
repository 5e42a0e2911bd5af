"""A step refused on one rank alone, or optimizer settings changed on one
rank alone, on 2 gloo ranks ([Note: writes agreed] in _step_agreement.py).
Before, the refusing rank raised while the other went on into the gradient
reduction and waited for it for good, and an lr changed on one rank trained
that rank's slice at another rate, silently. Now every rank raises, nothing
is updated, and training goes on once the setting is put back."""
import pytest

import harness

STAGES = [0, 1, 2, 3]


def disturbed_steps(rank, world):
    import torch
    from torch import nn
    import zero
    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = zero.initialize(model, optimizer=optimizer, stage=stage,
                                 stage3_param_persistence_threshold=0)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))

        def step():
            engine.backward(engine(x).square().mean())
            engine.step()
        step()
        group = optimizer.param_groups[0]
        disturbances = [  # (what, change on one rank, put back)
            ("a refused setting", lambda: group.update(nesterov=True),
             lambda: group.update(nesterov=False)),
            ("another lr", lambda: group.update(lr=0.2), lambda: group.update(lr=0.1)),
            ("a frozen parameter", lambda: model[2].bias.requires_grad_(False),
             lambda: model[2].bias.requires_grad_(True)),
        ]
        errors, unchanged = [], []
        for what, change, put_back in disturbances:
            before = engine.full_state_dict()
            if rank == 1:
                change()
            try:
                step()
                errors.append((what, None))
            except (RuntimeError, ValueError) as e:
                errors.append((what, f"{type(e).__name__}: {e}"))
            if rank == 1:
                put_back()
            engine.zero_grad()
            after = engine.full_state_dict()
            unchanged.append(all(torch.equal(before[k], after[k]) for k in before))
        step()  # goes on, on every rank
        out[stage] = (errors, unchanged, engine.full_state_dict(), engine.global_steps)
        engine.close()
    return out


@pytest.fixture(scope="module")
def results():
    return harness.run(2, disturbed_steps, timeout=240)


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_refused_or_changed_on_one_rank_stops_every_rank(results, stage):
    import torch
    for rank, out in enumerate(results):
        errors, unchanged, _final, steps = out[stage]
        assert all(unchanged), (rank, unchanged)
        assert steps == 2, (rank, steps)
        by_what = dict(errors)
        assert all(by_what.values()), (rank, errors)
        if rank == 1:
            assert "nesterov" in by_what["a refused setting"]
            assert "requires_grad=False" in by_what["a frozen parameter"]
        else:
            for what in ("a refused setting", "a frozen parameter"):
                assert "another rank refused to go on" in by_what[what], by_what[what]
        assert "param group settings are not alike" in by_what["another lr"]
        assert "lr=0.2" in by_what["another lr"] if rank == 1 else \
            "lr=0.1" in by_what["another lr"]
    for key, value in results[0][stage][2].items():
        assert torch.equal(results[1][stage][2][key], value), key

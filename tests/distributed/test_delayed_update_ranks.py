"""offload_optimizer.delayed_update on 2 gloo ranks: the pending update
lands through the collectives of the next boundary (the all-gather of the
new parameters, on every rank at the same point). Both ranks train on the
same batches, so the average of their gradients is the gradient of one,
and each rank must match the one-step-late torch reference of
tests/test_delayed_update.py within its 1e-5; stage 3 also with the
parameter shard on the host (the gradient partition is then on the host
too, and the delayed update copies it from there)."""
import pytest
import torch

import harness


def train(rank, world, stage, params):
    import zero
    from engine_cases import ACCUMULATION, batches, loss_of, place_apart
    from test_delayed_update import STEPS, delayed_engine
    place_apart(params=params, states=True)
    options = {"offload_param": {"device": "cpu"}} if params else {}
    engine = delayed_engine(stage, **options)
    for tokens, targets in batches("cpu", STEPS * ACCUMULATION):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    pending = engine._delayed.pending
    full = engine.full_state_dict()
    engine.close()
    del zero
    return pending, full


def every_stage(rank, world):
    return {(stage, params): train(rank, world, stage, params)
            for stage, params in ((1, False), (2, False), (3, False), (3, True))}


@pytest.fixture(scope="module")
def results():
    return harness.run(2, every_stage)


@pytest.mark.parametrize("stage,params", [(1, False), (2, False), (3, False), (3, True)])
def test_two_ranks_land_each_update_one_step_late(results, stage, params):
    from conftest import max_rel_error
    from engine_cases import ACCUMULATION, batches
    from test_delayed_update import STEPS, one_step_late_reference
    w, _ = one_step_late_reference("adamw", batches("cpu", STEPS * ACCUMULATION))
    for rank, by_case in enumerate(results):
        pending, full = by_case[(stage, params)]
        assert pending, rank
        for name, value in w.state_dict().items():
            error = max_rel_error(full[name], value)
            assert error <= 1e-5, f"rank {rank} stage {stage}: {name} off by {error:.2e}"
    assert all(torch.equal(results[0][(stage, params)][1][k], v)
               for k, v in results[1][(stage, params)][1].items())

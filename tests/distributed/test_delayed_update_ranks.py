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


def one_rank_update_fails(rank, world):
    """Stage 2, states on the host: rank 1's update thread fails at the
    second update (a disk gone). Returns (the step's error, its seconds)."""
    import time
    from engine_cases import ACCUMULATION, batches, loss_of, place_apart
    from test_delayed_update import delayed_engine
    place_apart(params=False, states=True)
    engine = delayed_engine(2, timeout=60)
    if rank == 1:
        real = engine._delayed.step_path

        class Failing:
            calls = 0

            def __getattr__(self, name):
                return getattr(real, name)

            def update_delayed(self, *args):
                Failing.calls += 1
                if Failing.calls >= 2:
                    raise OSError("the states' disk is gone (rank 1 only)")
                return real.update_delayed(*args)
        engine._delayed.step_path = Failing()
    start = time.monotonic()
    try:
        for tokens, targets in batches("cpu", 4 * ACCUMULATION):
            engine.backward(loss_of(engine(tokens), targets))
            engine.step()
    except (OSError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}", time.monotonic() - start
    return None, time.monotonic() - start


def test_an_update_that_fails_on_one_rank_stops_every_rank_at_once():
    """The other rank's refused step used to land its own update, a gather
    no peer met: it waited out the timeout (review of stop 34)."""
    (error0, seconds0), (error1, seconds1) = harness.run(2, one_rank_update_fails, timeout=200)
    assert error1.startswith("OSError: the states' disk is gone"), error1
    assert error0.startswith("RuntimeError: another rank refused"), error0
    assert seconds0 < 30 and seconds1 < 30, (seconds0, seconds1)

"""An optimizer holding states when zero.initialize takes it over, on 2
gloo ranks: each rank copies its partition's slice of them. The engine,
each rank on half of every batch, continues the torch run that trained on
whole batches, within 1e-5 (the ranks sum in another order)."""
import pytest

import harness

STAGES = [1, 2, 3]


def continue_on_ranks(rank, world):
    import zero
    from test_resumed_states import data, resumed
    out = {}
    for name in ("adamw", "sgd", "adagrad"):
        for stage in STAGES:
            _finished, m, opt = resumed(name)
            engine = zero.initialize(m, optimizer=opt, stage=stage)
            for x in data()[3:]:
                mine = x.chunk(world)[rank]
                engine.backward(engine(mine).square().mean())
                engine.step()
            out[name, stage] = engine.full_state_dict()
            engine.close()
    finished = {name: resumed(name)[0].state_dict() for name in ("adamw", "sgd", "adagrad")}
    return out, finished


@pytest.fixture(scope="module")
def results():
    return harness.run(2, continue_on_ranks)


@pytest.mark.parametrize("name", ["adamw", "sgd", "adagrad"])
@pytest.mark.parametrize("stage", STAGES)
def test_ranks_start_from_the_optimizers_states(results, name, stage):
    from conftest import max_rel_error
    for out, finished in results:
        for key, value in finished[name].items():
            assert max_rel_error(out[name, stage][key], value) <= 1e-5, (name, stage, key)


def states_on_one_rank_only(rank, world):
    import zero
    from test_resumed_states import OPTIMIZERS, data, model, torch_steps
    m = model()
    opt = OPTIMIZERS["adamw"](m.parameters())
    if rank == 0:  # only rank 0 ran a torch step: its states (and weights) differ
        torch_steps(m, opt, data()[:1])
        m.load_state_dict(model().state_dict())  # the weights alike again
    try:
        zero.initialize(m, optimizer=opt, stage=2)
    except ValueError as e:
        return str(e)
    return "initialized"


def test_states_held_on_some_ranks_only_are_refused_on_every_rank():
    """Each rank would take in its own: the ranks compare them first (one
    rank refusing alone would leave the other waiting)."""
    for message in harness.run(2, states_on_one_rank_only, timeout=120):
        assert "the ranks differ in their optimizer states" in message, message


def states_left_behind(rank, world):
    import warnings
    import torch
    import zero
    from test_resumed_states import OPTIMIZERS, data, model
    m = model()
    opt = OPTIMIZERS["adamw"](m.parameters())
    engine = zero.initialize(m, optimizer=opt, stage=2)
    engine.backward(engine(data()[0].chunk(world)[rank]).square().mean())
    engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.close()
    errors = []
    for attempt in (opt.step, opt.state_dict,
                    lambda: zero.initialize(m, optimizer=opt, stage=2)):
        try:
            attempt()
            errors.append(None)
        except (RuntimeError, ValueError) as e:
            errors.append(str(e))
    opt.load_state_dict(torch.optim.AdamW(m.parameters()).state_dict())  # states again
    engine = zero.initialize(m, optimizer=opt, stage=2)
    engine.close()
    return [str(w.message) for w in caught], errors


def test_states_left_partitioned_at_close_are_not_started_afresh_silently():
    """close() on 2 ranks keeps the states partitioned (gathering them could
    need more memory than the run had): no warning at the usual end of a
    run, but the optimizer's step(), state_dict() and a new initialize,
    which would start them afresh, raise until load_state_dict gives it
    states again."""
    for caught, errors in harness.run(2, states_left_behind, timeout=120):
        assert caught == [], caught
        assert all(e is not None and "stayed partitioned over the ranks" in e
                   for e in errors), errors

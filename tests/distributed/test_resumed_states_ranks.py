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

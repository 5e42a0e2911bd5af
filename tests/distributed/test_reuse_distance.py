"""stage3_max_reuse_distance on 2 gloo ranks ([Note: reuse distance] in
sharding/_pass_order.py): the units a forward ends with are kept for the
backward that starts with them instead of released and gathered again.
What a distance keeps is counted exactly in gathered elements; the
training is bit for bit the one that releases every unit (the same values
reach the same buffers) and matches one process's plain torch run; an
evaluation forward keeps nothing, and units kept for a backward that never
came are released by the next forward."""
import pytest
import torch

import harness
import zero
from conftest import max_rel_error
from scenarios import blocks_batches, make_blocks


def _unit_of(engine, param):
    for fg in engine.all_groups:
        for unit in fg.units:
            if any(p is param for p in unit.params):
                return unit
    raise AssertionError("no unit holds the parameter")


def _train(rank, world, reuse):
    model = make_blocks()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0,
                             stage3_max_reuse_distance=reuse)
    units = [u for fg in engine.all_groups for u in fg.units]
    sizes = {"all": sum(u.total for u in units),
             "head": _unit_of(engine, model.head.weight).total}
    gathered = []
    mine, _ = blocks_batches(rank, world, steps=5)
    for i, ids in enumerate(mine):
        if i == len(mine) - 1:
            with torch.no_grad():  # an evaluation: no backward follows, nothing kept
                engine(ids)
            after_eval = [u.gathered for u in units]
            engine(ids)  # a forward whose backward never comes
            after_unused = sum(u.gathered for u in units)
        engine.backward(engine(ids))
        engine.step()
        gathered.append(engine.comm_summary()["ops"]["all_gather"]["elements"])
    state = engine.full_state_dict()
    engine.close()
    return state, gathered, sizes, after_eval, after_unused


def _train_each(rank, world):
    """{reuse distance: _train's answer} for 0 (every unit released), 1,
    the head's size + 1 and 1e9, one engine after another in one launch."""
    runs = {0: _train(rank, world, 0)}
    head = runs[0][2]["head"]
    for reuse in (1, head + 1, 10**9):
        runs[reuse] = _train(rank, world, reuse)
    return runs


@pytest.mark.parametrize("world", [2])
def test_reuse_distance_keeps_the_turn_and_changes_no_number(world):
    answers = harness.run(world, _train_each)
    # 1: only the unit used next (the head: the forward's last, the
    # backward's first); a head and a bit: the next after it is the head's
    # own forward use again for the last block, so still only the head;
    # 1e9: every unit (a forward's units all come back in its backward)
    head = answers[0][0][2]["head"]
    runs = {reuse: [mine[reuse] for mine in answers] for reuse in (1, head + 1, 10**9)}
    for rank in range(world):
        state0, gathered0, sizes, after_eval, after_unused = answers[rank][0]
        assert not any(after_eval) and after_unused == 0
        # the first step records the order; a forward gathers every unit
        # once and so does a backward
        assert gathered0[1:4] == [2 * sizes["all"]] * 3
        expected = {1: sizes["all"] * 2 - head, head + 1: sizes["all"] * 2 - head,
                    10**9: sizes["all"]}
        for reuse, results in runs.items():
            state, gathered, _sizes, after_eval, after_unused = results[rank]
            assert gathered[1:4] == [expected[reuse]] * 3, reuse
            assert not any(after_eval), reuse
            assert after_unused > 0, reuse  # kept, then released by the next forward
            for name in state0:
                assert torch.equal(state[name], state0[name]), (reuse, name)
    ref = make_blocks()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for every in blocks_batches(0, world, steps=5)[1]:
        opt.zero_grad()
        ref(every).backward()
        opt.step()
    for name, p in ref.state_dict().items():
        assert max_rel_error(answers[0][0][0][name], p) < 1e-5, name

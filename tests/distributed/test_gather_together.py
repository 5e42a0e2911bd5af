"""Stage 3's small units gathered together on gloo ([Note: small units
gathered together] in comm/_gather_together.py): on 2 and 3 ranks, a
prefetch of several small units, and the refresh of the persistent units
after a step, is one collective instead of one per unit, and the training
is bit for bit the one with a collective per unit (the same values reach
the same buffers), which itself matches one process's plain torch run.
Also at construction: small units seeded by one broadcast and the
persistent ones gathered together ([Note: seeding small units together])."""
import pytest
import torch

import harness
import zero
from conftest import max_rel_error
from scenarios import blocks_batches, blocks_reference, make_blocks
from zero.comm._gather_together import TOGETHER
from zero.sharding import _flat_group


def _train_both(rank, world, threshold):
    """(_train's answer with small units gathered together, and without):
    one launch for both."""
    together = _train(rank, world, threshold)
    _flat_group.gathers_together = lambda comm: False
    return together, _train(rank, world, threshold)


def _train(rank, world, threshold):
    model = make_blocks()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=threshold)
    gathers = []
    mine, _ = blocks_batches(rank, world)
    for ids in mine:
        engine.backward(engine(ids))
        engine.step()
        gathers.append(engine.comm_summary()["ops"]["all_gather"])  # this step's
    state = engine.full_state_dict()
    peak = engine.memory_summary()["gathered_peak"]
    engine.close()
    return state, gathers, peak


@pytest.mark.parametrize("world, threshold", [(2, 0), (3, 0), (2, 10**5)])
def test_small_units_go_together_and_change_no_number(world, threshold):
    """threshold 0: every unit released, prefetched together; 1e5: every
    unit persistent, refreshed together after each step."""
    together, apart = zip(*harness.run(world, _train_both, threshold))
    for (state, gathers, peak), (state_apart, gathers_apart, peak_apart) in zip(together, apart):
        if threshold == 0:
            # the batches' shared buffers count as gathered memory; a
            # batch sends at most TOGETHER elements a rank (fp32 here)
            assert peak_apart < peak <= peak_apart + (world + 1) * TOGETHER * 4
        for name in state:
            assert torch.equal(state[name], state_apart[name]), name
        for step, (joined, alone) in enumerate(zip(gathers, gathers_apart)):
            assert joined["elements"] == alone["elements"], step
            if step > 0:  # the first pass records the order: nothing prefetched
                assert joined["calls"] < alone["calls"] / 2, (step, joined, alone)
    for name, p in blocks_reference(world).items():
        assert max_rel_error(together[0][0][name], p) < 1e-5, name


def _construction_broadcasts(rank, world, threshold):
    """torch.distributed.broadcast calls while initialize builds Blocks at
    stage 3 (gloo's gathers are broadcasts too), and the model it built."""
    import torch.distributed as dist
    calls, real = [0], dist.broadcast

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    dist.broadcast = counting
    try:
        model = make_blocks()
        engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 stage=3, stage3_param_persistence_threshold=threshold)
    finally:
        dist.broadcast = real
    state = engine.full_state_dict()
    engine.close()
    return calls[0], state


@pytest.mark.parametrize("world", [2, 3])
def test_small_units_are_seeded_and_kept_together(world):
    """[Note: seeding small units together] in sharding/_flat_group.py:
    Blocks' 7 small units are seeded by one broadcast, not one each, and
    (the default threshold keeps them all) gathered for good by one
    gather of `world` broadcasts, not one each; the values are the model's."""
    ref = make_blocks().state_dict()
    for threshold, most in ((0, 2), (10**5, 2 + world)):
        for calls, state in harness.run(world, _construction_broadcasts, threshold):
            assert calls <= most, (threshold, calls)
            for name, value in ref.items():
                assert torch.equal(state[name], value), name


def _checks_a_step(rank, world, threshold):
    """Comm.gather_ints calls (the matched-gathers check of [Note: matched
    gathers] in sharding/_gathering.py is one) in each of 3 steps of Blocks."""
    from zero.comm import _comm
    calls, real = [0], _comm.Comm.gather_ints

    def counting(self, values):
        calls[0] += 1
        return real(self, values)
    model = make_blocks()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=threshold)
    _comm.Comm.gather_ints = counting
    counts = []
    try:
        for ids in blocks_batches(rank, world)[0][:3]:
            calls[0] = 0
            engine.backward(engine(ids))
            engine.step()
            counts.append(calls[0])
    finally:
        _comm.Comm.gather_ints = real
    engine.close()
    return counts


def test_no_matched_gathers_check_when_nothing_is_released():
    """Every unit persistent (Blocks under the default threshold): no pass
    gathers anything, so the check that the ranks gathered the same units
    is skipped (two small all-gathers a step on gloo); with every unit
    released it runs after the forward and the backward."""
    kept = harness.run(2, _checks_a_step, 10**5)
    released = harness.run(2, _checks_a_step, 0)
    assert all(counts == [0, 0, 0] for counts in kept), kept
    assert all(all(n >= 2 for n in counts) for counts in released), released

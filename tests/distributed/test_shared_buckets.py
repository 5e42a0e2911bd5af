"""Stage 3's small units sharing gradient buckets ([Note: small units share
a bucket] in csrc/zero.h): on 2 and 3 gloo ranks, consecutive units whose
chunks fit in a bucket are reduced together, rank-major, in one reduce per
rank (or one reduce-scatter), where each unit took a reduce per rank of
its own. Checked against the same engine with every unit in buckets of its
own (the plan without unit parts), and against one process's plain torch
run: the bucket sizes give shared buckets beside units alone, everything
in one bucket, and units too big to share cut into ranges."""
import pytest
import torch

import harness
import zero
from conftest import max_rel_error
from scenarios import blocks_batches, blocks_reference, make_blocks
from zero.sharding import _buckets

# Blocks' units in fp32 on 2 ranks: embed 512 and head 544 elements, a
# block about 1.7k. From the last unit, 2500 puts the head with the last
# block, leaves blocks 3, 2 and 1 each alone (two do not fit) and puts
# the embedding with the first block; 10**6 puts every unit in one
# bucket; 1000 shares none (no two neighbours fit) and cuts each block in
# two ranges, the plan of before.
BUCKETS = (2500, 10**6, 1000)


def _apart():
    """Every unit in buckets of its own: the plan without unit parts."""
    real = _buckets._GradBuckets
    _buckets._GradBuckets = lambda *args, unit_parts=None, chunks=1, **kw: real(*args, **kw)


def _train(rank, world, bucket, reduction="reduce", force_scatter=False):
    model = make_blocks()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0,
                             reduce_bucket_size=bucket, bucket_reduction=reduction)
    shared = [len(fg.reducer.shared) for fg in engine.all_groups if fg.reducer]
    if force_scatter:
        # the reduce_scatter NCCL gets, run on gloo (which has one): the
        # engine otherwise takes gloo's all-reduce for it
        for fg in engine.all_groups:
            if fg.reducer is not None:
                fg.reducer._gloo = False
    mine, _ = blocks_batches(rank, world)
    calls = []
    for ids in mine:
        engine.backward(engine(ids))
        engine.step()
        ops = engine.comm_summary()["ops"]  # this step's
        calls.append({op: ops[op]["calls"] for op in ("reduce", "reduce_scatter", "all_reduce")
                      if op in ops})
    state = engine.full_state_dict()
    engine.close()
    return state, calls, shared


def _all_ways(rank, world):
    together = {bucket: _train(rank, world, bucket) for bucket in BUCKETS}
    scatter = _train(rank, world, 2500, "reduce_scatter", force_scatter=True)
    gloo_scatter = _train(rank, world, 2500, "reduce_scatter")
    _apart()
    apart = {bucket: _train(rank, world, bucket) for bucket in BUCKETS}
    return together, apart, scatter, gloo_scatter


@pytest.mark.parametrize("world", [2, 3])
def test_small_units_share_buckets(world):
    ref = blocks_reference(world)
    for together, apart, scatter, gloo_scatter in harness.run(world, _all_ways):
        for bucket in BUCKETS:
            state, calls, shared = together[bucket]
            state_apart, calls_apart, shared_apart = apart[bucket]
            assert shared_apart == [0] and (shared[0] > 0) == (bucket != 1000), (bucket, shared)
            # sums of the same values: two ranks' are one addition, bit
            # for bit; three ranks' may be added in another order
            for name, value in state.items():
                if world == 2:
                    assert torch.equal(value, state_apart[name]), (bucket, name)
                assert max_rel_error(value, ref[name]) < 1e-5, (bucket, name)
            for step, (joined, alone) in enumerate(zip(calls, calls_apart)):
                if bucket == 1000:
                    assert joined == alone, (step, joined, alone)
                else:
                    assert joined["reduce"] < alone["reduce"], (bucket, step, joined, alone)
            if bucket == 10**6:  # one bucket: one reduce per rank a step
                assert all(c["reduce"] == world for c in calls), calls
        for state, calls, _shared in (scatter, gloo_scatter):
            for name, value in state.items():
                assert max_rel_error(value, ref[name]) < 1e-5, name
        # the forced path went by reduce_scatter, gloo's way by all-reduce
        assert all(c.get("reduce_scatter", 0) > 0 and "reduce" not in c for c in scatter[1])
        assert all("reduce_scatter" not in c and "reduce" not in c for c in gloo_scatter[1])

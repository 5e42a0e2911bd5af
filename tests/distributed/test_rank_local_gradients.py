"""Parameters that get a gradient on some ranks only (a data-dependent
branch inside a module every rank runs), from the first backward on, with
one and with two param groups, on 2 gloo ranks. A bucket then leaves
mid-backward on one rank and at the end of backward on the other; before
each group reduced on a channel of its own ([Note: reduction channels] in
_comm.py), stage 2 paired one group's bucket with the other's (silently
wrong when the sizes matched, a hang when not) and stage 3 paired buckets
with all-gathers (a hang)."""
import pytest
import torch
import torch.nn.functional as F

import harness
from conftest import max_rel_error
from scenarios import GatedBlocks

WORLD, STEPS, ACCUMULATION, WIDTH, LAYERS = 2, 3, 2, 16, 6


def make_model():
    torch.manual_seed(0)
    return GatedBlocks(LAYERS, WIDTH)


def make_optimizer(model, groups):
    if groups == 1:
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    # each group a few buckets: a rank held up in one group's reduction
    # while its peer waits in the other's would hang both
    even = [p for k, b in enumerate(model.blocks) if k % 2 == 0 for p in b.parameters()]
    odd = [p for k, b in enumerate(model.blocks) if k % 2 for p in b.parameters()]
    return torch.optim.AdamW([{"params": even, "weight_decay": 0.01},
                              {"params": odd + list(model.head.parameters()),
                               "weight_decay": 0.0}], lr=1e-2)


def skipped(step, micro, rank):
    """Each rank skips another gate on each micro-step: every gate is used
    on one rank and not the other, from the first backward."""
    return {(2 * step + micro + rank) % LAYERS}


def data(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


def reference(groups):
    """One process: each micro-step's gradient is the mean over the ranks'
    losses, as the engine's reduction makes it; unused blocks take part
    with zero gradients (set_to_none=False), as under the engine."""
    model = make_model()
    opt = make_optimizer(model, groups)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        for micro in range(ACCUMULATION):
            for rank in range(WORLD):
                x, y = data(step, micro, rank)
                loss = F.mse_loss(model(x, skipped(step, micro, rank)), y)
                (loss / (ACCUMULATION * WORLD)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank, world, stage):
    import zero
    out = {}
    for groups in (1, 2):
        model = make_model()
        # stage 3 gathers each unit when backward reaches it (no prefetch),
        # so a rank held up in a reduction holds its peer's next gather
        extra = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                 "stage3_max_live_parameters": 0} if stage == 3 else {}
        engine = zero.initialize(model, optimizer=make_optimizer(model, groups),
                                 stage=stage, gradient_accumulation_steps=ACCUMULATION,
                                 gradient_clipping=1.0, reduce_bucket_size=WIDTH * WIDTH // 2,
                                 **extra)
        for step in range(STEPS):
            for micro in range(ACCUMULATION):
                x, y = data(step, micro, rank)
                engine.backward(F.mse_loss(engine(x, skipped(step, micro, rank)), y))
                engine.step()
        out[groups] = engine.full_state_dict()
        engine.close()
    return out


_runs = {}


def results(stage):
    """Both groupings of a stage in one launch of 2 processes."""
    if stage not in _runs:  # a failure too, so a hang costs one timeout
        try:
            _runs[stage] = harness.run(WORLD, train, stage, timeout=120)
        except Exception as e:
            _runs[stage] = e
    if isinstance(_runs[stage], Exception):
        raise _runs[stage]
    return _runs[stage]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("groups", [1, 2])
def test_rank_local_gradients_match_reference(stage, groups):
    ref = reference(groups)
    for rank, out in enumerate(results(stage)):
        state = out[groups]
        for name, value in ref.items():
            # fp32, 3 Adam steps: a few ulps of summation order per step
            assert max_rel_error(state[name], value) < 1e-5, (rank, name)


def channels(rank, world):
    """Process groups alive after each of 3 dropped engines (2 param groups
    each), then whether the model trains again after the default group was
    destroyed and made anew."""
    import gc
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world
    import zero
    counts = []
    for _ in range(3):
        model = make_model()
        engine = zero.initialize(model, optimizer=make_optimizer(model, 2), stage=2)
        x, y = data(0, 0, rank)
        engine.backward(F.mse_loss(engine(x, set()), y))
        engine.step()
        del engine
        gc.collect()
        counts.append(len(_world.pg_map))
    model = make_model()
    engine = zero.initialize(model, optimizer=make_optimizer(model, 2), stage=2)
    # a port free now (MASTER_PORT + 1 may be another test's under xdist)
    port = [harness.free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank,
                            world_size=world)
    again = zero.initialize(model, optimizer=make_optimizer(model, 2), stage=2)
    x, y = data(0, 0, rank)
    again.backward(F.mse_loss(again(x, set()), y))
    again.step()
    closed = engine._closed
    again.close()
    return counts, closed


def test_channels_are_kept_for_the_process():
    """An engine dropped without close() leaks no process group (before: 2
    gloo groups, 6 threads and 10 descriptors each); a default group made
    anew gets new channels (before: the old engine's close() raised on its
    destroyed channel, and the model could not be initialized again)."""
    for counts, closed in harness.run(WORLD, channels, timeout=120):
        assert counts == [counts[0]] * 3, counts  # the default group and 2 channels
        assert closed

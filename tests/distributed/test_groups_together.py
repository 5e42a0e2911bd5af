"""Many param groups (layer-wise learning rates: two groups a block) on 2
and 3 gloo ranks, stages 0-3: the per-group collectives of a step go
together ([Note: small groups reduced together] in
comm/_reduce_together.py, [Note: small groups' buckets] in
sharding/_buckets.py, refresh_params in sharding/_groups_together.py).
Checked against one process's plain torch with the same groups, and by
the collectives a step: no more than the same model in one group issues
(before, a few a group: 28 groups on 2 ranks paid 55 reduces, 28 flag
all-reduces and 56 broadcasts a step at stage 2)."""
import pytest
import torch
import torch.nn.functional as F

import harness
from conftest import max_rel_error
from scenarios import GatedBlocks, Net, batch, shard

STEPS, ACCUMULATION, WIDTH, LAYERS = 3, 2, 16, 5
OPS = ("reduce", "all_reduce", "all_gather", "broadcast")


def make(kind):
    torch.manual_seed(0)
    return GatedBlocks(LAYERS, WIDTH) if kind == "gated" else Net()


def layerwise(model, many):
    """Two groups a top-level module (matrices with weight decay, the rest
    without), the learning rate decaying toward the input, as layer-wise
    decay recipes build them; or all in one group."""
    if not many:
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    groups, seen = [], set()
    modules = list(model.blocks) + [model.head] if isinstance(model, GatedBlocks) else \
        [m for m in model.children()]
    for depth, module in enumerate(modules):
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        lr = 1e-2 * 0.8 ** (len(modules) - depth)
        for decay, chosen in ((0.01, [p for p in params if p.ndim == 2]),
                              (0.0, [p for p in params if p.ndim != 2])):
            if chosen:
                groups.append({"params": chosen, "lr": lr, "weight_decay": decay})
    return torch.optim.AdamW(groups, lr=1e-2)


def skipped(step, micro, rank):
    """Each rank skips another gate on each micro-step."""
    return {(2 * step + micro + rank) % LAYERS}


def gated_data(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


def losses(model, step, micro, rank, world, kind):
    """This rank's loss of a micro-step."""
    if kind == "gated":
        x, y = gated_data(step, micro, rank)
        return F.mse_loss(model(x, skipped(step, micro, rank)), y)
    ids, labels = batch(step)
    ids, labels = shard(ids, rank, world), shard(labels, rank, world)
    ids, labels = ids.chunk(ACCUMULATION)[micro], labels.chunk(ACCUMULATION)[micro]
    return F.cross_entropy(model(ids, use_branch=step % 2 == 0), labels)


def reference(kind, world):
    """One process: each micro-step's gradient the mean of the ranks'
    losses, as the engine's reduction makes it; unused parameters step
    with zero gradients (set_to_none=False), as under the engine."""
    model = make(kind)
    opt = layerwise(model, many=True)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        for micro in range(ACCUMULATION):
            for rank in range(world):
                loss = losses(model, step, micro, rank, world, kind)
                (loss / (ACCUMULATION * world)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank, world):
    import zero
    out = {}
    for kind in ("gated", "net"):
        for stage in range(4):
            for many in (True, False):
                model = make(kind)
                engine = zero.initialize(model, optimizer=layerwise(model, many), stage=stage,
                                         gradient_accumulation_steps=ACCUMULATION,
                                         gradient_clipping=1.0)
                deferred = sum(fg.reducer.deferred is not None for fg in engine.groups
                               if fg.reducer is not None)
                calls = []
                for step in range(STEPS):
                    for micro in range(ACCUMULATION):
                        engine.backward(losses(engine, step, micro, rank, world, kind))
                        engine.step()
                    ops = engine.comm_summary()["ops"]  # this step's
                    calls.append({op: ops[op]["calls"] for op in OPS if op in ops})
                out[kind, stage, many] = (engine.full_state_dict(), calls, deferred,
                                          len(engine.groups))
                engine.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_many_groups_train_as_torch_with_one_groups_collectives(world):
    refs = {kind: reference(kind, world) for kind in ("gated", "net")}
    for rank, out in enumerate(harness.run(world, train, timeout=240)):
        for (kind, stage, many), (state, calls, deferred, groups) in out.items():
            if not many:
                continue
            where = (rank, kind, stage)
            assert groups >= 6, where
            for name, value in refs[kind].items():
                # fp32, 3 AdamW steps: a few ulps of summation order a step
                assert max_rel_error(state[name], value) < 1e-5, (where, name)
            # stages 2-3: the small groups' buckets wait for the end of
            # the backward, all of them (the default bucket holds them)
            assert deferred == (groups if stage >= 2 else 0), (where, deferred)
            _state, one_group_calls, _d, _g = out[kind, stage, False]
            for step, (mine, one) in enumerate(zip(calls, one_group_calls)):
                for op in OPS:
                    assert mine.get(op, 0) <= one.get(op, 0), (where, step, op, mine, one)

"""close() lets go of the engine's own buffers (engine/_handback.py,
drop_engine_buffers): a name kept after close() (`engine` in a notebook)
or the last loss of a stage-3 run (its graph's hooks hold the schedule)
kept the shards, masters, gradient partitions and optimizer states
alive, about the model states twice over."""
import gc
import os
import weakref

import pytest
import torch
from torch import nn

import zero


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _engine_tensors(engine):
    """Weak references to the tensors the engine made for itself."""
    found = []
    for fg in engine.all_groups:
        for name in ("shard", "master", "grad_part", "grad_flat"):
            t = getattr(fg, name, None)
            if t is not None:
                found.append((name, t))
        found += [(f"state {k}", t) for k, t in fg.states.items()]
    if engine._schedule is not None and engine._schedule.pool is not None:
        found += [("pooled", t) for ts in engine._schedule.pool.free.values() for t in ts]
    return [(name, weakref.ref(t)) for name, t in found]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_close_frees_the_engine_buffers_while_engine_and_loss_are_kept(stage, precision):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = zero.initialize(model, optimizer=opt, stage=stage, precision=precision,
                             stage3_param_persistence_threshold=0)
    dtype = engine.compute_dtype
    for _ in range(2):
        loss = engine(torch.randn(8, 16, dtype=dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    loss = engine(torch.randn(8, 16, dtype=dtype)).float().pow(2).mean()  # a graph kept
    refs = _engine_tensors(engine)
    assert len(refs) >= 3
    engine.close()
    gc.collect()
    alive = [name for name, r in refs if r() is not None]
    # at stages 0-2 the model's parameters are views of the engine's flat
    # buffer (the shard is a piece of it): the parameters keep that storage,
    # which is the model's own; the engine's tensor objects still go
    assert alive == [], f"close() kept {alive} alive (stage {stage}, {precision})"
    assert loss.requires_grad  # the graph is still held
    # the model is a plain one again: it trains under torch
    x = torch.randn(8, 16)
    model(x).pow(2).mean().backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_closed_parameters_have_storage_of_their_own(tmp_path, stage, precision):
    """A plain model's parameter has a storage of its own: at fp32 stages
    0-2 each stayed a view of the engine's flat buffer, so torch.save(p)
    wrote the whole model and safetensors' save_model refused the shared
    storage (HF export hunt)."""
    model = _model()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=stage, precision=precision)
    engine.backward(engine(torch.randn(8, 16, dtype=engine.compute_dtype)).float().sum())
    engine.step()
    full = engine.full_state_dict()
    engine.close()
    for name, p in model.named_parameters():
        assert p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.nbytes, name
        assert torch.equal(p.detach(), full[name]), name
    torch.save(model[2].weight, tmp_path / "w.pt")
    assert os.path.getsize(tmp_path / "w.pt") < model[2].weight.nbytes + 2048


@pytest.mark.parametrize("stage", [0, 1])
def test_close_keeps_unstepped_gradients_and_drops_zeros(stage):
    """Stages 0-1: .grad views the engine's flat gradient. After a step
    (zeros) close() leaves None, as torch's zero_grad does; after a
    backward with no step, the gradients are the user's: kept, equal to
    torch's."""
    model = _model()
    reference = _model()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=stage)
    x = torch.randn(8, 16)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.close()
    assert all(p.grad is None for p in model.parameters())

    model = _model()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=stage)
    engine.backward(engine(x).pow(2).mean())
    engine.close()
    reference(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def _held_in(folder) -> int:
    """This process's descriptors and mappings of files under `folder` (the
    offload files are unlinked at creation: only these hold their space)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += str(folder) in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as maps:
        held += sum(str(folder) in line for line in maps)
    return held


def test_a_dropped_stage3_engine_with_a_kept_loss_gives_its_files_back(tmp_path):
    """Dropped without close() while a loss held its graph (a notebook cell
    run again): the engine's master and state files stayed open and mapped,
    holding their disk space, and the next initialize on a small disk
    failed for want of room."""
    def cell():
        model = _model()
        engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                                 stage=3, precision="bf16",
                                 stage3_param_persistence_threshold=0,
                                 offload_optimizer={"device": "nvme",
                                                    "nvme_path": str(tmp_path)})
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        engine.backward(engine(x).float().square().mean())
        engine.step()
        return engine, engine(x).float().square().mean()  # an evaluation loss, kept
    engine, loss = cell()
    assert _held_in(tmp_path) > 0
    del engine
    gc.collect()
    assert _held_in(tmp_path) == 0
    del loss

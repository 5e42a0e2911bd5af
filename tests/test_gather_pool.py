"""Stage 3's gather pool on the CPU ([Note: gather pool] in
sharding/_units.py): released unit buffers are taken back by the next
gathers of the same size; training is bit for bit what it is without the
pool; the gathered units and the pool together never hold more than the
peak gathered (memory_summary's gathered_peak); a buffer that a tensor
still views is never reused under it."""
import copy

import pytest
import torch

import zero
from engine_cases import no_launcher

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def tiny_gpt2():
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64,
                                  n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def train(model, pooled, steps=3, watch=None):
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=3, stage3_param_persistence_threshold=0)
    schedule = engine._schedule
    if not pooled:
        schedule.pool = None
    taken, held = [0], []
    if pooled:
        take = schedule.pool.take

        def counted(numel, dtype):
            t = take(numel, dtype)
            taken[0] += t is not None
            held.append((schedule.live, schedule.pool.nbytes, schedule.peak_live))
            return t
        schedule.pool.take = counted
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state, taken[0], held


def test_the_pool_reuses_buffers_and_changes_no_number():
    pooled, taken, held = train(tiny_gpt2(), pooled=True)
    plain, _, _ = train(tiny_gpt2(), pooled=False)
    assert taken > 10  # blocks of one size take each other's buffers
    for name, value in plain.items():
        assert torch.equal(pooled[name], value), name
    for live, pooled_bytes, peak in held:  # fp32: 4 bytes an element
        assert live * 4 + pooled_bytes <= peak * 4


def test_a_buffer_still_viewed_is_not_reused():
    """A forward hook that keeps a view of a block's weight (a logging
    hook): the release leaves that storage to it, so later gathers of
    other blocks into pooled buffers never overwrite what it sees."""
    model = tiny_gpt2()
    kept = []
    model.transformer.h[0].attn.c_attn.register_forward_hook(
        lambda m, i, o: kept.append((m.weight.detach(), m.weight.detach().clone())))
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                             stage=3, stage3_param_persistence_threshold=0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(3):
            engine(input_ids=ids)
    for view, copied in kept:
        assert torch.equal(view, copied)
    engine.close()


def test_parameter_views_are_made_once_per_buffer(monkeypatch):
    """[Note: parameter views]: a unit's parameter views are made when a
    buffer first serves that layout, then travel with the buffer through
    the pool: after the first step no gather makes them again, and the
    pool still takes buffers back (the views count as the buffer's own
    holders, not as somebody's view)."""
    from zero.sharding._units import Unit
    made = []
    point = Unit.point_params

    def counted(unit):
        made.append(unit._views is None)
        point(unit)
    monkeypatch.setattr(Unit, "point_params", counted)
    model = tiny_gpt2()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=3, stage3_param_persistence_threshold=0)
    g = torch.Generator().manual_seed(3)
    per_step = []
    for _ in range(3):
        made.clear()
        ids = torch.randint(0, 64, (2, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        per_step.append((sum(made), len(made)))
    engine.close()
    assert all(gathers > 0 for _, gathers in per_step)
    assert per_step[-1][0] == 0, per_step  # every gather found its views made


def test_a_pooled_release_reuses_its_spare_buffer():
    """A release into the pool leaves the unit a `full` without bytes;
    that tensor is kept and handed back at the next such release (no
    allocation a release once the pool serves the gathers), and never
    holds bytes while a unit is released."""
    model = tiny_gpt2()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=3, stage3_param_persistence_threshold=0)
    units = [u for fg in engine.all_groups for u in fg.units if not u.persistent]
    g = torch.Generator().manual_seed(3)
    spares = []
    for _ in range(4):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        for u in units:
            assert not u.gathered and u.full.untyped_storage().nbytes() == 0
        spares.append([id(u._spare) for u in units])
    assert spares[-1] == spares[-2]
    engine.close()

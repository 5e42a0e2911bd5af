"""Ranks that go different ways in a training script, on 2 gloo ranks,
each raising on every rank with what differs instead of training wrong,
aborting inside gloo or waiting out the timeout ([Note: writes agreed] in
sharding/_step_agreement.py): step() skipped on each rank at another batch
(stages 0-1 summed other numbers of batches, silently), an evaluation or a
generate() on rank 0 alone at stage 3 (a hang, an abort), checkpoints
loaded under other tags on each rank (one model made of two checkpoints,
silently), saved under other tags (an error that blamed the filesystem),
zero.GatheredParameters entered with other parameters (wrong values) or
another modifier_rank (a hang)."""
import os
import re

import pytest

import harness
import scenarios


def _attempt(function):
    try:
        function()
        return None
    except (RuntimeError, ValueError) as e:
        return str(e)


def _engine(stage, **options):
    import torch
    from torch import nn
    import zero
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           stage=stage, stage3_param_persistence_threshold=0, **options)


def _skipped_steps(rank, stage):
    """Rank 1 skips step() at batch 1, rank 0 at batch 2: each rank's
    second step() meets the other's with another number of backwards."""
    import torch
    engine = _engine(stage)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    def train(batch):
        engine.backward(engine(x).square().mean())
        if batch != 2 - rank:
            engine.step()
    for batch in range(4):
        error = _attempt(lambda: train(batch))
        if error is not None:
            break
    engine.close()
    return batch, error


def _alone_at_stage_3(rank, call):
    """After a step, rank 0 evaluates (or generates) alone while rank 1
    goes on training."""
    import torch
    engine = _engine(3)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).square().mean())
    engine.step()

    def train():
        engine.backward(engine(x).square().mean())
        engine.step()

    def alone():
        with torch.no_grad():
            if call == "eval":
                engine(x)
            else:
                engine.generate(x, generate_fn=lambda module, ids: module(ids))
    error = _attempt(alone if rank == 0 else train)
    engine.close()
    return error


def _other_tags(rank, directory, stage):
    """Checkpoints 'a' and 'b' saved by both ranks (b: a's values + 1);
    then rank 0 loads 'a' and rank 1 'b'; then each saves under its own
    tag. Returns (load error, parameters unchanged by it, save error)."""
    import torch
    import zero
    engine = _engine(stage)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.save_checkpoint(directory, tag="a")
    params = list(engine.module.parameters())
    with zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        for p in params:
            p.add_(1.0)
    engine.save_checkpoint(directory, tag="b")
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    load_error = _attempt(lambda: engine.load_checkpoint(directory, tag="ab"[rank]))
    after = engine.full_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    save_error = _attempt(lambda: engine.save_checkpoint(directory, tag=f"rank{rank}"))
    # latest written by rank 0's call alone (a DDP habit): it decided
    # whether one more agreement ran, and rank 1 returned while rank 0
    # raised, the ranks a collective apart from then on
    latest_error = _attempt(lambda: engine.save_checkpoint(directory, tag="c",
                                                           save_latest=rank == 0))
    # what a load takes, other on each rank: rank 1 restarted its slice of
    # the optimizer alone, silently
    flags_error = _attempt(lambda: engine.load_checkpoint(
        directory, tag="a", load_optimizer_states=rank == 0))
    listed = sorted(os.listdir(directory))
    with open(os.path.join(directory, "latest")) as f:
        listed.append(f.read())  # still the last save's
    engine.backward(engine(x).square().mean())  # and training goes on
    engine.step()
    engine.close()
    return load_error, unchanged, save_error, latest_error, listed, flags_error


def _gathered_apart(rank, case):
    """zero.GatheredParameters at stage 3 entered with other parameters
    (case "params") or another modifier_rank (case "modifier") on each rank."""
    import zero
    engine = _engine(3)
    model = engine.module
    params = [model[0].weight if rank == 0 or case == "modifier" else model[2].weight]
    modifier = rank if case == "modifier" else None

    def enter():
        with zero.GatheredParameters(params, modifier_rank=modifier):
            pass
    error = _attempt(enter)
    engine.close()
    return error


def _recovered_by_zero_grad(rank, directory, stage):
    """Rank 0 saves alone while rank 1 trains on: both refused. Then
    zero_grad() and three steps on every rank, as the refusal says.
    Returns (refusal, errors of the steps after, final state, batches)."""
    import torch
    engine = _engine(stage)
    batches = [scenarios.small_mlp_batch(k, rank) for k in range(5)]

    def train(k):
        engine.backward(engine(batches[k]).square().mean())
        engine.step()
    train(0)
    refusal = _attempt(lambda: engine.save_checkpoint(directory) if rank == 0 else train(1))
    engine.zero_grad()
    errors = [_attempt(lambda: train(k)) for k in (2, 3, 4)]
    state = engine.full_state_dict()
    engine.close()
    return refusal, errors, state


def divergent(rank, world, directory):
    out = {}
    # (not stage 2: rank 1's backward reduces, and its collectives meet the
    # save's agreement in gloo, which aborts on the sizes: docs/engine.md)
    for stage in (0, 1, 3):
        out["recovered", stage] = _recovered_by_zero_grad(
            rank, os.path.join(directory, f"recovered{stage}"), stage)
    for case in ("params", "modifier"):
        out["gathered", case] = _gathered_apart(rank, case)
    for stage in (0, 1, 3):
        out["skipped step", stage] = _skipped_steps(rank, stage)
    for call in ("eval", "generate"):
        out[call] = _alone_at_stage_3(rank, call)
    for stage in (1, 3):
        out["tags", stage] = _other_tags(rank, os.path.join(directory, str(stage)), stage)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return harness.run(2, divergent, str(tmp_path_factory.mktemp("tags")), timeout=240)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_step_skipped_at_other_batches_raises_on_both(results, stage):
    """Before, stages 0-1 stepped on, one rank's update of two batches'
    gradients averaged with the other's of one (stage 3 was caught)."""
    for rank, out in enumerate(results):
        batch, error = out["skipped step", stage]
        assert error is not None and "not in the same engine call" in error, (rank, error)
        assert batch == 1 + rank  # each rank's second step(), or at stage 3 its forward
        if stage < 3:
            assert re.search(f"and {1 + rank} backwards of engine \\d+ at update 1", error), error
        else:  # caught before by the forward's agreement: a collective there
            assert ("step()" if rank == 0 else "forward 3 of engine") in error, error


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_training_goes_on_after_a_refused_call_and_zero_grad(results, stage):
    """Before, rank 1's backward before the refused call stayed counted
    at stages 0-1 (zero_grad() did not reset the count), so every later
    step() was refused as taken at another number of backwards; at stage
    3 rank 1's refused forward stayed counted, and every later forward was
    refused."""
    from conftest import max_rel_error
    # one process: the average gradient of both ranks' batches 0, 2, 3, 4
    reference = scenarios.small_mlp_reference((0, 2, 3, 4))
    for rank, out in enumerate(results):
        refusal, errors, state = out["recovered", stage]
        assert refusal is not None and "not in the same engine call" in refusal and \
            "engine.zero_grad() on every rank" in refusal, refusal
        assert errors == [None, None, None], errors
        for key, value in reference.items():
            assert max_rel_error(state[key], value) <= 1e-5, (rank, key)


@pytest.mark.parametrize("call", ["eval", "generate"])
def test_a_stage3_call_on_rank_0_alone_raises_on_both(results, call):
    """Before: the evaluation's forward agreed with rank 1's training
    forward and both hung in the backward's gathers until the timeout;
    generate() aborted inside gloo or waited out the timeout."""
    mine, theirs = results[0][call], results[1][call]
    assert "not in the same engine call" in mine and "not in the same engine call" in theirs
    assert re.search(r"forward 2 of engine \d+ \(no grad, train\)" if call == "eval" else
                     r"generate\(gather='auto'\) of engine", mine), mine
    assert re.search(r"forward 2 of engine \d+ \(grad, train\)", theirs), theirs


@pytest.mark.parametrize("case", ["params", "modifier"])
def test_gathered_parameters_entered_apart_raise_on_both(results, case):
    """Before: other parameters on each rank paired their gathers (rank 1
    got wrong values of another shape, silently); other modifier ranks
    waited in each other's broadcasts until the timeout."""
    for rank, out in enumerate(results):
        error = out["gathered", case]
        assert error is not None and "not in the same engine call" in error, (rank, error)
        unit = 0 if rank == 0 or case == "modifier" else 1  # model[2]: the second unit
        modifier = rank if case == "modifier" else None
        assert f"with the units [(0, {unit})], modifier_rank {modifier}" in error, error


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoints_under_other_tags_are_refused_on_both(results, stage):
    """Before, the load took rank 0's partition from 'a' and rank 1's from
    'b', silently; the save blamed the filesystem for the other's shard."""
    for rank, out in enumerate(results):
        load_error, unchanged, save_error, latest_error, listed, flags_error = out["tags", stage]
        assert "not in the same engine call" in flags_error, flags_error
        assert f"load_checkpoint(load_optimizer_states={rank == 0}," in flags_error
        assert "not in the same engine call" in latest_error, latest_error
        assert f"save_latest={rank == 0}" in latest_error
        assert listed == ["a", "b", "latest", "zero_to_fp32.py", "b"], listed  # nothing written
        assert load_error.startswith("load_checkpoint: the ranks resolved different "
                                     "checkpoints (this rank: "), load_error
        assert load_error.endswith(f"{os.sep}{'ab'[rank]}'); give every rank the same tag, "
                                   "or the same 'latest'. Nothing was loaded")
        assert unchanged
        assert "not in the same engine call" in save_error, save_error
        assert f"save_checkpoint(tag='rank{rank}', save_latest=True)" in save_error


def _gathered_in_another_order(rank, world, stage):
    """zero.GatheredParameters over the same parameters listed in another
    order on each rank (as a set of them is: its order follows the
    tensors' ids), with a write on rank 0."""
    import torch
    import zero
    engine = _engine(stage)
    params = list(engine.module.parameters())
    if rank == 1:
        params.reverse()
    with zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        if rank == 0:
            engine.module[0].bias.fill_(3.0)
    state = engine.full_state_dict()
    engine.close()
    return state["0.bias"].tolist()


@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_parameters_agree_whatever_the_order_they_are_given_in(stage):
    """Before: the units were agreed in the caller's order: refused on
    every rank (stage 3's two units; at stage 1 one group, one unit)."""
    for bias in harness.run(2, _gathered_in_another_order, stage, timeout=120):
        assert bias == [3.0] * 8


def _two_engines_in_other_orders(rank, world, stage):
    """Two engines of the same architecture; rank 0 runs (stage 3) or steps
    (stages 1-2) the first then the second, rank 1 the other way round."""
    import torch
    first, second = _engine(stage), _engine(stage)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    order = (first, second) if rank == 0 else (second, first)

    def run():
        if stage == 3:
            with torch.no_grad():
                for engine in order:
                    engine(x)
        else:
            for engine in (first, second):
                engine.backward(engine(x).square().mean())
            for engine in order:
                engine.step()
    error = _attempt(run)
    first.close()
    second.close()
    return error


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_engines_called_in_other_orders_raise_on_both(stage):
    """Before: each engine's call agreed with the other engine's on the
    other rank (equal counts, equal unit indices): stage 3's forwards gave
    mixed values, and at stages 1-2 each rank's first engine took the
    other's update, silently."""
    for rank, error in enumerate(harness.run(2, _two_engines_in_other_orders, stage,
                                             timeout=120)):
        assert error is not None and "not in the same engine call" in error, (rank, error)
        assert re.search(r"of engine \d+", error)


def _two_engines_backwards_in_other_orders(rank, world, stage):
    """Two engines of one architecture, their forwards in one order on both
    ranks, the backwards in the other order on rank 1."""
    import torch
    first, second = _engine(stage), _engine(stage)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    losses = [engine(x).square().mean() for engine in (first, second)]
    pairs = list(zip((first, second), losses))

    def run():
        for engine, loss in (pairs if rank == 0 else pairs[::-1]):
            engine.backward(loss)
    error = _attempt(run)
    first.close()
    second.close()
    return error


@pytest.mark.parametrize("stage", [2, 3])
def test_two_engines_backwards_in_other_orders_raise_on_both(stage):
    """The two engines' reductions share channels (and at stage 3 their
    passes gathered units of the same places, so their hashes agreed): each
    rank's collectives paired with the other engine's, and both models
    trained 0.5-0.65 relative off torch, silently (lifecycle hunt). Each
    backward's end agrees the engine's serial now ([Note: one engine's
    backward end] in sharding/_buckets.py; stage 3's pass hash holds it
    too)."""
    for rank, error in enumerate(harness.run(2, _two_engines_backwards_in_other_orders,
                                             stage, timeout=120)):
        assert error is not None and "two engines" in error and "other orders" in error, \
            (rank, error)


def _boundary_on_one_rank(rank, world, stage):
    """Rank 0 alone says the first micro-step is a boundary (2 micro-steps
    an update); after the refusal both ranks drop the batch, give the count
    back, and train on."""
    import torch
    engine = _engine(stage, gradient_accumulation_steps=2)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))

    def micro_step():
        engine.backward(engine(x).square().mean())
        engine.step()
    if rank == 0:
        engine.set_gradient_accumulation_boundary(True)
    error = _attempt(micro_step)
    engine.zero_grad()
    engine.set_gradient_accumulation_boundary(None)
    for _ in range(4):
        micro_step()
    state = {k: v.tolist() for k, v in engine.full_state_dict().items()}
    steps = engine.global_steps
    engine.close()
    return error, state, steps


@pytest.mark.parametrize("stage", [2, 3])
def test_a_boundary_set_on_one_rank_raises_on_both(stage):
    """set_gradient_accumulation_boundary(True) on rank 0 alone: its step
    went into the update's collectives while rank 1 went on into the next
    backward's reductions, and at stage 2 gloo aborted both processes
    without a word (at stage 3 the forward's agreement found it). The end
    of each backward agrees whether the coming step updates ([Note: one
    engine's backward end]): a RuntimeError on both, and training goes on
    alike after zero_grad()."""
    results = harness.run(2, _boundary_on_one_rank, stage, timeout=120)
    for rank, (error, _state, steps) in enumerate(results):
        assert error is not None and "disagree on whether the coming step() updates" in error \
            and f"it {'does' if rank == 0 else 'does not'})" in error, (rank, error)
        assert steps == 2, (rank, steps)
    assert results[0][1] == results[1][1]


def _initialize_again_with_its_optimizer(rank, world):
    """zero.initialize(model, optimizer=the live engine's) on 2 ranks after
    an AdamW step (its states are counted steps): refused, the live engine
    untouched (it still gathers its state)."""
    import torch
    from torch import nn
    import zero
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=2)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).square().mean())
    engine.step()
    error = _attempt(lambda: zero.initialize(engine.module, optimizer=engine.optimizer,
                                             stage=2))
    saved = not engine._closed and len(engine.full_state_dict()) == 4  # still whole, collective
    engine.close()
    return error, saved


def test_initialize_again_with_the_live_engines_optimizer_keeps_that_engine():
    """Before: initialize closed the live engine first, then refused the
    optimizer whose states the close left partitioned, and pointed at a
    save_checkpoint() no engine was left to make."""
    for error, saved in harness.run(2, _initialize_again_with_its_optimizer, timeout=120):
        assert error.startswith("zero.initialize again on a model whose live engine trains "
                                "it, with that engine's optimizer, on 2 ranks"), error
        assert saved

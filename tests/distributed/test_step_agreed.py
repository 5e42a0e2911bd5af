"""A step refused on one rank alone, or optimizer settings changed on one
rank alone, on 2 gloo ranks ([Note: writes agreed] in _step_agreement.py).
Before, the refusing rank raised while the other went on into the gradient
reduction and waited for it for good, and an lr changed on one rank trained
that rank's slice at another rate, silently. Now every rank raises, nothing
is updated, and training goes on once the setting is put back."""
import pytest

import harness

STAGES = [0, 1, 2, 3]


def disturbed_steps(rank, world):
    import torch
    from torch import nn
    import zero
    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = zero.initialize(model, optimizer=optimizer, stage=stage,
                                 stage3_param_persistence_threshold=0)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))

        def step(after_backward=None):
            engine.backward(engine(x).square().mean())
            if after_backward is not None:
                after_backward()
            engine.step()
        group = optimizer.param_groups[0]
        group[0] = "a key that is no string"  # settings of any kind are compared
        step()
        disturbances = [  # (what, change on one rank, put back)
            ("a refused setting", lambda: group.update(nesterov=True),
             lambda: group.update(nesterov=False)),
            ("another lr", lambda: group.update(lr=0.2), lambda: group.update(lr=0.1)),
            ("a frozen parameter", lambda: model[2].bias.requires_grad_(False),
             lambda: model[2].bias.requires_grad_(True)),
        ]
        hooked = []  # [Note: optimizer step hooks]: a pre-hook that raises refuses

        def failing_hook(_optimizer, _args, _kwargs):
            raise KeyError("the user's step pre-hook")
        disturbances.append(("a pre-hook that raises",
                             lambda: hooked.append(optimizer.register_step_pre_hook(failing_hook)),
                             lambda: hooked.pop().remove()))
        if stage == 2:  # stages 0-1 take a hand-set .grad in; stage 3's is a placeholder
            # set after the backward (one set before it is added to, as in torch)
            disturbances.append(("a gradient set by hand", None,
                                 lambda: setattr(model[2].bias, "grad", None)))
        errors, unchanged = [], []
        for what, change, put_back in disturbances:
            before = engine.full_state_dict()
            if rank == 1 and change is not None:
                change()
            by_hand = (lambda: setattr(model[2].bias, "grad", torch.ones(3))) \
                if rank == 1 and change is None else None
            try:
                step(by_hand)
                errors.append((what, None))
            except (RuntimeError, ValueError, KeyError) as e:
                errors.append((what, f"{type(e).__name__}: {e}"))
            if rank == 1:
                put_back()
            engine.zero_grad()
            after = engine.full_state_dict()
            unchanged.append(all(torch.equal(before[k], after[k]) for k in before))
        step()  # goes on, on every rank
        out[stage] = (errors, unchanged, engine.full_state_dict(), engine.global_steps)
        engine.close()
    return out


@pytest.fixture(scope="module")
def results():
    return harness.run(2, disturbed_steps, timeout=240)


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_refused_or_changed_on_one_rank_stops_every_rank(results, stage):
    import torch
    for rank, out in enumerate(results):
        errors, unchanged, _final, steps = out[stage]
        assert all(unchanged), (rank, unchanged)
        assert steps == 2, (rank, steps)
        by_what = dict(errors)
        assert all(by_what.values()), (rank, errors)
        refused = ["a refused setting", "a frozen parameter", "a pre-hook that raises"] + \
            (["a gradient set by hand"] if stage == 2 else [])
        if rank == 1:
            assert "nesterov" in by_what["a refused setting"]
            assert "requires_grad=False" in by_what["a frozen parameter"]
            assert "the user's step pre-hook" in by_what["a pre-hook that raises"]
            if stage == 2:
                assert "'2.bias' has a .grad set outside backward" in \
                    by_what["a gradient set by hand"]
        else:
            for what in refused:
                assert "another rank refused to go on" in by_what[what], by_what[what]
        assert "param group settings are not alike" in by_what["another lr"]
        assert "lr=0.2" in by_what["another lr"] if rank == 1 else \
            "lr=0.1" in by_what["another lr"]
    for key, value in results[0][stage][2].items():
        assert torch.equal(results[1][stage][2][key], value), key


def _attempt(function):
    try:
        function()
        return None
    except (RuntimeError, ValueError, OSError) as e:
        return str(e)


def calls_on_one_rank(rank, world):
    """A collective engine call made on rank 0 alone (the DDP habit of
    saving on rank 0) while rank 1 goes on to step(); an fp16 step after a
    plain backward on rank 1 alone; a block that raises inside
    GatheredParameters on rank 1 alone. Each case on a new engine."""
    import tempfile
    import torch
    from torch import nn
    import zero
    out = {}
    cases = [(stage, call) for stage in (0, 1) for call in ("full_state_dict", "save")] + \
        [(stage, "clip") for stage in STAGES] + [(2, "fp16"), (1, "gathered"), (3, "gathered")] + \
        [(stage, "zero_grad") for stage in (0, 2)] + [(3, "train_on")]
    for stage, call in cases:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 stage=stage, stage3_param_persistence_threshold=0,
                                 precision="fp16" if call == "fp16" else "fp32")
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
        errors = []
        if call == "train_on":  # rank 0 reads the model alone; rank 1 trains on
            engine.backward(engine(x).square().mean())
            engine.step()
            errors.append(_attempt(engine.full_state_dict if rank == 0 else lambda: engine(x)))
            engine.zero_grad()  # as the refusal advises: then training goes on

            def train_again():
                engine.backward(engine(x).square().mean())
                engine.step()
            errors.append(_attempt(train_again))
            errors.append(_attempt(train_again))
        elif call == "gathered":
            def block():
                with zero.GatheredParameters([model[0].weight], modifier_rank=0):
                    with torch.no_grad():
                        model[0].weight.fill_(7.0)
                    if rank == 1:
                        raise ValueError("the user's own error")
            errors.append(_attempt(block))
            engine.backward(engine(x).square().mean())
            engine.step()
            errors.append(bool((engine.full_state_dict()["0.weight"] == 7.0).any()))
        else:
            loss = engine(x).float().square().mean()
            if call == "fp16" and rank == 1:
                loss.backward()  # not engine.backward: unscaled
            else:
                engine.backward(loss)
            with tempfile.TemporaryDirectory() as folder:
                one_rank_call = {"full_state_dict": engine.full_state_dict,
                                 "save": lambda: engine.save_checkpoint(folder),
                                 "clip": lambda: engine.clip_grad_norm_(1.0),
                                 "fp16": engine.step, "zero_grad": engine.step}[call]
                if call == "zero_grad" and rank == 1:
                    model.zero_grad()  # drops this rank's gradients alone
                errors.append(_attempt(one_rank_call if rank == 0 else engine.step))
        out[stage, call] = errors
        engine.close()
    return out


@pytest.fixture(scope="module")
def one_rank_calls():
    return harness.run(2, calls_on_one_rank, timeout=240)


@pytest.mark.parametrize("stage,call", [(0, "full_state_dict"), (1, "full_state_dict"),
                                        (0, "save"), (1, "save"), (0, "clip"), (1, "clip"),
                                        (2, "clip"), (3, "clip")])
def test_a_collective_call_on_one_rank_raises_on_both(one_rank_calls, stage, call):
    """Before: a wrong error (settings not alike, with empty settings), a
    norm of 1e-157 made of the step check's integers, then a hang."""
    for rank, out in enumerate(one_rank_calls):
        [error] = out[stage, call]
        assert error is not None and "not in the same engine call" in error, (rank, error)
        assert ("step()" if rank == 1 else "at update 0, micro-step 0") in error


def test_a_call_on_one_rank_met_by_a_stage3_forward_raises_on_both(one_rank_calls):
    """full_state_dict on rank 0 alone while rank 1 trains on: before, its
    all-reduce met rank 1's gathers and both waited for good. After
    zero_grad() on both, training goes on."""
    for rank, out in enumerate(one_rank_calls):
        error, *after = out[3, "train_on"]
        assert error is not None and "not in the same engine call" in error, (rank, error)
        assert ("full_state_dict()" if rank == 0 else "(grad, train)") in error
        assert rank == 0 or "forward 2 of engine" in error
        # rank 1's refused forward was counted on rank 1 alone: every later
        # forward was refused, though the message said training goes on
        assert after == [None, None], (rank, after)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_zero_grad_on_one_rank_before_the_step_raises_on_both(one_rank_calls, stage):
    """Before, stage 0 stepped every parameter on rank 0's gradient alone
    and stage 2 half the model on the average, the other half on nothing."""
    for rank, out in enumerate(one_rank_calls):
        [error] = out[stage, "zero_grad"]
        assert error is not None and "not in the same engine call" in error, (rank, error)
        assert f"after {rank} zero_grad() calls" in error, error


def test_an_unscaled_fp16_step_on_one_rank_raises_on_both(one_rank_calls):
    """Before, the other rank waited in the step's agreement."""
    [mine], [theirs] = one_rank_calls[1][2, "fp16"], one_rank_calls[0][2, "fp16"]
    assert "fp16: step() needs an engine.backward(loss)" in mine
    assert "another rank refused to go on" in theirs


@pytest.mark.parametrize("stage", [1, 3])
def test_a_block_that_raised_inside_gathered_parameters_on_one_rank(one_rank_calls, stage):
    """Rank 1's block raised: the write-back (a broadcast) is skipped on
    every rank, the changes inside are undone, and rank 0 is told so;
    training goes on. Before, rank 0 waited in the broadcast."""
    (mine, kept_1), (theirs, kept_0) = (one_rank_calls[r][stage, "gathered"] for r in (1, 0))
    assert mine == "the user's own error"
    assert "another rank raised inside zero.GatheredParameters" in theirs
    assert not kept_0 and not kept_1


def a_failed_16bit_save(rank, world):
    import tempfile
    import torch
    from torch import nn
    import zero
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = zero.initialize(model, stage=3, precision="bf16")
    with tempfile.NamedTemporaryFile() as not_a_folder:  # rank 0 cannot write under it
        error = _attempt(lambda: engine.save_16bit_model(not_a_folder.name, "w.bin"))
    engine.close()
    return error


def test_a_16bit_save_that_fails_on_rank_0_raises_on_every_rank():
    """Only rank 0 writes: its failure is agreed, so rank 1 does not go on
    to wait at its next collective."""
    mine, theirs = harness.run(2, a_failed_16bit_save, timeout=120)
    assert mine is not None and "rank 0 failed" not in mine, mine
    assert theirs is not None and "rank 0 failed to write the file" in theirs, theirs

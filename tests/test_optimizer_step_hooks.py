"""The optimizer's step hooks and the lr scheduler under engine.step()
([Note: optimizer step hooks] in engine/_optimizer_step_hooks.py), each
against the same loop in plain torch.

Tolerance: fp32, a few AdamW updates of a small model, normwise relative
error at most 1e-5 (the engine's fused update differs from torch's by a
few ulps a step: tests/engine_cases.py). Each defect caught here is off by
1e-2 or more: a clamp or learning rate not applied, a gradient added twice.
"""
import copy

import pytest
import torch
from torch import nn
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

import zero
from conftest import max_rel_error
from engine_cases import Net, batches, loss_of, no_launcher as clear_launcher

TOL = 1e-5


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    clear_launcher(monkeypatch)


def twins(stage, seed=0):
    torch.manual_seed(seed)
    model = Net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    return model, opt, ref, ref_opt


def engine_of(model, opt, stage, **options):
    if stage == 3:
        options.setdefault("stage3_param_persistence_threshold", 0)
    return zero.initialize(model, optimizer=opt, stage=stage, **options)


def torch_step(ref, ref_opt, tokens, targets):
    loss_of(ref(tokens), targets).backward()
    ref_opt.step()
    ref_opt.zero_grad()


def engine_step(engine, tokens, targets):
    engine.backward(loss_of(engine(tokens), targets))
    engine.step()


def assert_matches(engine, ref):
    got = engine.full_state_dict()
    for name, p in ref.named_parameters():
        assert max_rel_error(got[name], p.detach()) <= TOL, name


def clamp_hook(optimizer, _args, _kwargs):
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.clamp_(-0.05, 0.05)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_post_hook_that_clamps_the_weights_is_applied(stage):
    model, opt, ref, ref_opt = twins(stage)
    ref_opt.register_step_post_hook(clamp_hook)
    opt.register_step_post_hook(clamp_hook)
    engine = engine_of(model, opt, stage)
    for tokens, targets in batches("cpu", 4):
        torch_step(ref, ref_opt, tokens, targets)
        engine_step(engine, tokens, targets)
    # without the hook the weights leave [-0.05, 0.05] at once (lr 1e-2)
    assert all(p.abs().max() <= 0.05 for p in ref.parameters())
    assert_matches(engine, ref)
    engine.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_hooks_run_once_an_update_in_torchs_order(stage):
    model, opt, _ref, _ref_opt = twins(stage)
    calls = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", a))),
               opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", a))),
               opt.register_step_post_hook(lambda o, a, k: calls.append(("post", a))),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", a)))]
    try:
        engine = engine_of(model, opt, stage, gradient_accumulation_steps=2)
        for tokens, targets in batches("cpu", 4):  # two updates
            engine_step(engine, tokens, targets)
        engine.close()
    finally:
        for handle in handles:
            handle.remove()
    names = [name for name, _args in calls]
    assert names == ["global pre", "pre", "post", "global post"] * 2
    assert all(args == (opt,) for _name, args in calls)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_pre_hook_that_sets_the_learning_rate_sets_this_update(stage):
    def warm_up(optimizer, _args, _kwargs):
        warm_up.calls += 1
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * min(1.0, warm_up.calls / 3)
    model, opt, ref, ref_opt = twins(stage)
    warm_up.calls = 0
    ref_opt.register_step_pre_hook(warm_up)
    data = batches("cpu", 4)
    for tokens, targets in data:
        torch_step(ref, ref_opt, tokens, targets)
    warm_up.calls = 0
    opt.register_step_pre_hook(warm_up)
    engine = engine_of(model, opt, stage)
    for tokens, targets in data:
        engine_step(engine, tokens, targets)
    assert_matches(engine, ref)
    engine.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_pre_hook_that_raises_refuses_the_step_and_changes_nothing(stage):
    model, opt, ref, ref_opt = twins(stage)
    (tokens, targets), = batches("cpu", 1)
    torch_step(ref, ref_opt, tokens, targets)

    def refuse(_optimizer, _args, _kwargs):
        raise ValueError("not now")
    handle = opt.register_step_pre_hook(refuse)
    engine = engine_of(model, opt, stage)
    engine.backward(loss_of(engine(tokens), targets))
    with pytest.raises(ValueError, match="not now"):
        engine.step()
    assert engine.global_steps == 0
    handle.remove()
    engine.step()  # the same gradients, reduced once: torch's one step
    assert engine.global_steps == 1
    assert_matches(engine, ref)
    engine.close()


def test_a_pre_hook_that_returns_step_arguments_is_refused_by_name():
    model, opt, _ref, _ref_opt = twins(0)

    def with_closure(optimizer, args, _kwargs):
        return args, {"closure": lambda: 0.0}
    opt.register_step_pre_hook(with_closure)
    engine = engine_of(model, opt, 0)
    (tokens, targets), = batches("cpu", 1)
    engine.backward(loss_of(engine(tokens), targets))
    with pytest.raises(RuntimeError, match="with_closure.*takes none"):
        engine.step()
    engine.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_failing_scheduler_leaves_no_gradient_for_the_next_step(stage):
    """OneCycleLR stepped past its total_steps raises after the update. A
    script that catches it and trains on must not get the old gradients
    added to the next step's (they were: 8.5e-2 off torch)."""
    model, opt, ref, ref_opt = twins(stage)
    data = batches("cpu", 4)
    sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=1e-2, total_steps=2)
    for tokens, targets in data:
        loss_of(ref(tokens), targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        try:
            sched.step()
        except ValueError:
            pass
    engine = engine_of(model, opt, stage, lr_scheduler=torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=1e-2, total_steps=2))
    failures = 0
    for tokens, targets in data:
        try:
            engine_step(engine, tokens, targets)
        except ValueError as error:
            assert "Tried to step" in str(error)
            failures += 1
    assert failures == 2 and engine.global_steps == 4
    assert_matches(engine, ref)
    engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_failing_post_hook_is_raised_after_the_update(stage):
    model, opt, ref, ref_opt = twins(stage)
    data = batches("cpu", 2)
    for tokens, targets in data:
        torch_step(ref, ref_opt, tokens, targets)

    def once(_optimizer, _args, _kwargs):
        once.calls += 1
        if once.calls == 1:
            raise KeyError("logger down")
    once.calls = 0
    opt.register_step_post_hook(once)
    engine = engine_of(model, opt, stage)
    with pytest.raises(KeyError, match="logger down"):
        engine_step(engine, *data[0])
    assert engine.global_steps == 1
    engine_step(engine, *data[1])
    assert_matches(engine, ref)
    engine.close()


def test_post_hooks_do_not_run_on_a_skipped_fp16_step():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    posts = []
    opt.register_step_post_hook(lambda o, a, k: posts.append(1))
    engine = zero.initialize(model, optimizer=opt, stage=2, precision="fp16")
    x = torch.randn(2, 4, dtype=torch.float16)
    applied = 0
    for i in range(40):  # the first inf, then the loss scale halves until no overflow
        loss = engine(x).float().mean()
        engine.backward(loss * float("inf") if i == 0 else loss)
        engine.step()
        applied += not engine.step_was_skipped
    assert engine.skipped_steps >= 1 and applied >= 10
    assert len(posts) == applied
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_reduce_lr_on_plateau_steps_on_the_metric_lr_kwargs_give(stage, tmp_path):
    """ReduceLROnPlateau was refused at initialize, though DeepSpeed steps
    it with engine.step(lr_kwargs={"metrics": ...}); without the metric the
    step is refused before anything changes (torch's step() raised after
    the update). The metrics below stall, so the lr drops after patience 1:
    the engine matches torch's loop at every step, save and load included."""
    model, opt, ref, ref_opt = twins(stage)
    plateau = dict(mode="min", factor=0.5, patience=1)
    engine = engine_of(model, opt, stage,
                       lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **plateau))
    ref_sched = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, **plateau)
    data = batches("cpu", 6)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.backward(loss_of(engine(data[0][0]), data[0][1]))
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau, which steps on the metric .*"
                       r"lr_kwargs=\{'metrics': value\}.*Nothing was updated"):
        engine.step()
    assert engine.global_steps == 0
    for name, value in engine.full_state_dict().items():
        assert torch.equal(value, before[name]), name
    engine.zero_grad()
    metrics = [1.0, 0.9, 0.95, 0.97, 0.99, 0.98]
    for (tokens, targets), metric in zip(data, metrics):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step(lr_kwargs={"metrics": metric})
        torch_step(ref, ref_opt, tokens, targets)
        ref_sched.step(metric)
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        assert_matches(engine, ref)
    assert opt.param_groups[0]["lr"] == pytest.approx(2.5e-3)  # halved twice
    engine.save_checkpoint(tmp_path, tag="plateau")
    engine.close()
    model, opt, _ref, _ref_opt = twins(stage, seed=1)
    engine = engine_of(model, opt, stage,
                       lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **plateau))
    engine.load_checkpoint(tmp_path, tag="plateau")
    assert engine.lr_scheduler.state_dict() == ref_sched.state_dict()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.5e-3)
    engine.close()


def test_step_passes_deepspeeds_lr_kwargs_and_refuses_a_closure():
    """DeepSpeed's engine.step(lr_kwargs=...) hands them to the scheduler's
    step(); torch's optimizer.step(closure) habit got "step() takes 1
    positional argument"."""
    class Scaled(torch.optim.lr_scheduler.LRScheduler):
        def __init__(self, optimizer):
            self.factor = 1.0
            super().__init__(optimizer)

        def step(self, factor=1.0):
            self.factor = factor
            super().step()

        def get_lr(self):
            return [base * self.factor for base in self.base_lrs]
    model, opt, _ref, _ref_opt = twins(0)
    engine = engine_of(model, opt, 0, lr_scheduler=Scaled(opt))
    (tokens, targets), = batches("cpu", 1)
    engine.backward(loss_of(engine(tokens), targets))
    with pytest.raises(TypeError, match="takes no closure"):
        engine.step(lambda: 0.0)
    with pytest.raises(TypeError, match="lr_kwargs must be a dict .* got float"):
        engine.step(0.5)
    assert engine.global_steps == 0
    engine.step(lr_kwargs={"factor": 0.5})
    assert engine.global_steps == 1 and opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    engine.close()


def test_a_stage3_post_hook_writes_inside_gathered_parameters_or_is_named():
    """At stage 3 the parameters a post-hook reaches are released: a write
    there is dropped and refused naming the hook (it surfaced at the next
    step as a change 'where stage 3 cannot keep it', with no cause); the
    same hook inside zero.GatheredParameters matches torch."""
    model, opt, ref, ref_opt = twins(3)
    ref_opt.register_step_post_hook(clamp_hook)
    handle = opt.register_step_post_hook(clamp_hook)
    engine = engine_of(model, opt, 3)
    data = batches("cpu", 4)
    with pytest.raises(RuntimeError, match="an optimizer step post-hook .* at stage 3, where "
                                           "the parameters are released.* wrote a parameter"):
        engine_step(engine, *data[0])
    assert engine.global_steps == 1  # the update is applied, the write dropped
    assert max(v.abs().max() for v in engine.full_state_dict().values()) > 0.05
    engine.close()

    def gathered_clamp(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with zero.GatheredParameters(params, modifier_rank=0):
            clamp_hook(optimizer, args, kwargs)
    model, opt, ref, ref_opt = twins(3)
    ref_opt.register_step_post_hook(clamp_hook)
    opt.register_step_post_hook(gathered_clamp)
    handle.remove()
    engine = engine_of(model, opt, 3)
    for tokens, targets in data:
        torch_step(ref, ref_opt, tokens, targets)
        engine_step(engine, tokens, targets)
    assert_matches(engine, ref)
    engine.close()


def test_a_post_hook_sees_this_steps_norm_and_applied():
    model, opt, _ref, _ref_opt = twins(2)
    seen = []
    opt.register_step_post_hook(
        lambda o, a, k: seen.append((engine.was_step_applied(), engine.get_global_grad_norm())))
    engine = engine_of(model, opt, 2)
    norms = []
    for tokens, targets in batches("cpu", 2):
        engine_step(engine, tokens, targets)
        norms.append(engine.get_global_grad_norm())
    assert seen == [(True, norms[0]), (True, norms[1])] and norms[0] != norms[1]
    engine.close()

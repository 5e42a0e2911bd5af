"""engine.save_checkpoint / load_checkpoint and zero.checkpoint in one
process: a run cut in two at any stage and resumed at any other stage ends
bit for bit where the uninterrupted run ends (same process count, so the
same arithmetic in the same order: any state not restored shows); and
every bad input is refused before anything changes.

Across world sizes, and consolidated into plain torch, in
tests/distributed/test_checkpoint_resharding.py."""
import collections
import copy
import enum
import gc
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import zero
from conftest import max_rel_error
from zero.checkpoint._command import main as command_main
from engine_cases import Net, batches, loss_of, make_optimizer, no_launcher

STEPS = 6


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def make_engine(stage, precision="fp32", optimizer="adamw", seed=0, accumulation=1, **options):
    torch.manual_seed(seed)
    model = Net()
    opt = make_optimizer(optimizer, model.parameters())
    # its lr follows from its step count, which the checkpoint must restore
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
    if precision == "fp16":
        options["loss_scaling"] = zero.LossScaling(initial_scale_power=8, loss_scale_window=2)
    return zero.initialize(model, optimizer=opt, stage=stage, precision=precision,
                           lr_scheduler=sched, gradient_clipping=0.5,
                           gradient_accumulation_steps=accumulation, **options)


def train(engine, first, count, accumulation=1):
    data = batches("cpu", STEPS * accumulation)
    for i in range(first * accumulation, (first + count) * accumulation):
        tokens, targets = data[i]
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()


def finish(engine):
    state = engine.full_state_dict()
    facts = (engine.global_steps, engine.micro_steps, engine.skipped_steps, engine.loss_scale,
             [g["lr"] for g in engine.optimizer.param_groups])
    engine.close()
    return state, facts


def resumed_equals_uninterrupted(tmp_path, save_stage, load_stage, precision="fp32",
                                 optimizer="adamw", accumulation=1):
    whole = make_engine(save_stage, precision, optimizer, accumulation=accumulation)
    train(whole, 0, STEPS, accumulation)
    expected, expected_facts = finish(whole)

    first = make_engine(save_stage, precision, optimizer, accumulation=accumulation)
    train(first, 0, 3, accumulation)
    first.save_checkpoint(tmp_path, client_state={"next": 3})
    first.close()
    # another seed: every value must come from the checkpoint
    second = make_engine(load_stage, precision, optimizer, seed=1, accumulation=accumulation)
    path, client_state = second.load_checkpoint(tmp_path)
    assert path == os.path.join(tmp_path, "global_step3")
    train(second, client_state["next"], STEPS - 3, accumulation)
    state, facts = finish(second)
    assert facts == expected_facts
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("optimizer", ["adamw", "adam_amsgrad", "sgd_nesterov", "adagrad",
                                       "lion"])
@pytest.mark.parametrize("stages", [(0, 3), (3, 1), (2, 2)], ids=lambda s: f"{s[0]}to{s[1]}")
def test_fp32_resume_is_exact(tmp_path, optimizer, stages):
    resumed_equals_uninterrupted(tmp_path, *stages, optimizer=optimizer)


@pytest.mark.parametrize("save_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("load_stage", [0, 1, 2, 3])
def test_bf16_resume_is_exact(tmp_path, save_stage, load_stage):
    resumed_equals_uninterrupted(tmp_path, save_stage, load_stage, "bf16")


@pytest.mark.parametrize("stages", [(2, 3), (3, 2)], ids=lambda s: f"{s[0]}to{s[1]}")
def test_fp16_resume_keeps_the_loss_scale(tmp_path, stages):
    """The scale doubles every 2 steps here: a scale not restored changes
    the fp16 gradients' rounding, and the result."""
    resumed_equals_uninterrupted(tmp_path, *stages, precision="fp16", accumulation=2)


def test_skipped_step_count_is_restored(tmp_path):
    first = make_engine(2, "fp16")
    train(first, 0, 1)
    first.skipped_steps = 5  # as if 5 fp16 steps had overflowed
    first.save_checkpoint(tmp_path)
    first.close()
    second = make_engine(1, "fp16", seed=1)
    second.load_checkpoint(tmp_path)
    assert second.skipped_steps == 5
    second.close()


def test_files_are_plain_and_consolidate_to_the_full_state(tmp_path):
    engine = make_engine(3, "bf16")
    train(engine, 0, 3)
    path = engine.save_checkpoint(tmp_path, tag="mine", client_state={"epoch": 2})
    full = engine.full_state_dict()
    engine.close()
    for name in os.listdir(path):  # nothing but tensors, numbers, strings
        torch.load(os.path.join(path, name), weights_only=True)
    state = zero.checkpoint.consolidate(tmp_path)
    assert state["client_state"] == {"epoch": 2} and state["global_steps"] == 3
    assert list(state["model"]) == list(full)
    for key, value in full.items():
        assert torch.equal(state["model"][key], value), key
    model = Net()
    model.load_state_dict(state["model"], strict=True)
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(state["optimizer"])
    assert all(float(s["step"]) == 3 for s in opt.state.values()) and len(opt.state) == 9


class Counted(nn.Linear):
    """A module with extra state (get_extra_state / set_extra_state): its
    count of forwards, as a dict or as a tensor."""
    kind = "dict"

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)

    def get_extra_state(self):
        if self.kind == "tensor":
            return torch.tensor([float(self.calls)], dtype=torch.float64)
        return {"calls": self.calls, "note": ["kept"]}

    def set_extra_state(self, state):
        self.calls = int(state[0]) if self.kind == "tensor" else state["calls"]


@pytest.mark.parametrize("kind", ["dict", "tensor"])
@pytest.mark.parametrize("stage", [0, 3])
def test_extra_state_is_kept_and_given_back(tmp_path, monkeypatch, stage, kind):
    """Before, full_state_dict() and save_checkpoint() failed on a dict
    (AttributeError: .detach()), and a tensor was saved but never given
    back: set_extra_state did not run (interop hunt)."""
    monkeypatch.setattr(Counted, "kind", kind)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(Counted(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model = build()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=stage, stage3_param_persistence_threshold=0)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
    full = engine.full_state_dict()
    expected = model[0].get_extra_state()
    if kind == "tensor":
        assert full["0._extra_state"].dtype == torch.float64  # not cast as a buffer is
        assert torch.equal(full["0._extra_state"], expected)
    else:
        assert full["0._extra_state"] == expected == {"calls": 3, "note": ["kept"]}
    engine.save_checkpoint(str(tmp_path))
    engine.close()
    for name in os.listdir(tmp_path / "global_step3"):
        torch.load(tmp_path / "global_step3" / name, weights_only=True)
    again = build()
    engine = zero.initialize(again, optimizer=torch.optim.SGD(again.parameters(), lr=0.1),
                             stage=stage)
    engine.load_checkpoint(str(tmp_path))
    assert again[0].calls == 3
    engine.close()
    plain = build()
    plain.load_state_dict(zero.checkpoint.consolidate(tmp_path)["model"])  # torch's own load
    assert plain[0].calls == 3
    # the command too (it wrote the file, then failed counting a dict's elements)
    assert command_main([str(tmp_path), str(tmp_path / "model.pt")]) == 0
    plain = build()
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert plain[0].calls == 3


class WithEmpty(nn.Module):
    """A model with a parameter of no elements (an empty vocabulary
    extension, an unused adapter)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.empty = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.body(x).square().mean() + self.empty.sum()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_of_no_elements_resumes_with_the_others(tmp_path, stage):
    """Before, the save kept no optimizer states for it (it lies in no
    shard) and every load with optimizer states then refused the checkpoint
    for want of them (checkpoint hunt). The resumed run ends bit for bit
    where the uninterrupted one does."""
    def build():
        torch.manual_seed(0)
        model = WithEmpty()
        return zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                               stage=stage, stage3_param_persistence_threshold=0)
    data = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def steps(engine, xs):
        losses = []
        for x in xs:
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses
    whole = build()
    expected = steps(whole, data)
    expected_state = whole.full_state_dict()
    whole.close()
    first = build()
    steps(first, data[:2])
    first.save_checkpoint(tmp_path)
    first.close()
    resumed = build()
    resumed.load_checkpoint(tmp_path)
    assert steps(resumed, data[2:]) == expected[2:]
    got = resumed.full_state_dict()
    assert got["empty"].shape == (0, 4)
    for name, value in expected_state.items():
        assert torch.equal(got[name], value), name
    resumed.close()


def test_extra_state_a_checkpoint_cannot_hold_is_refused_by_name(tmp_path, monkeypatch):
    class Opaque:
        pass
    monkeypatch.setattr(Counted, "get_extra_state", lambda self: Opaque())
    model = nn.Sequential(Counted(8, 8))
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"the extra state of module '0' "
                                        r"\(Counted.get_extra_state\(\)\)"):
        engine.save_checkpoint(str(tmp_path))
    # a checkpoint without it (saved from a plain Linear) does not load into it
    plain = nn.Sequential(nn.Linear(8, 8))
    saver = zero.initialize(plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1))
    saver.save_checkpoint(str(tmp_path / "plain"))
    saver.close()
    with pytest.raises(ValueError, match=r"the checkpoint has no extra state '0._extra_state'"):
        engine.load_checkpoint(str(tmp_path / "plain"))
    engine.close()


def test_extra_state_without_set_extra_state_is_refused_before_the_load(tmp_path, monkeypatch):
    """get_extra_state without set_extra_state: refused by name before
    anything loads (torch's internal error came half-way through the load,
    the weights taken and the settings not) (review)."""
    monkeypatch.setattr(Counted, "set_extra_state", nn.Module.set_extra_state)
    model = nn.Sequential(Counted(8, 8))
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    engine.save_checkpoint(str(tmp_path))
    before = engine.full_state_dict()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    changed = engine.full_state_dict()
    with pytest.raises(ValueError, match=r"module '0' \(Counted\) defines get_extra_state but "
                                         r"not set_extra_state"):
        engine.load_checkpoint(str(tmp_path))
    after = engine.full_state_dict()
    assert torch.equal(after["0.weight"], changed["0.weight"])  # nothing was loaded
    assert not torch.equal(after["0.weight"], before["0.weight"])
    engine.close()


def test_command_line_writes_a_torch_state_dict(tmp_path):
    engine = make_engine(2)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path / "ckpt")
    full = engine.full_state_dict()
    engine.close()
    out = tmp_path / "model.pt"
    done = subprocess.run([sys.executable, "-m", "zero.checkpoint", str(tmp_path / "ckpt"),
                           str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout
    assert "RuntimeWarning" not in done.stderr, done.stderr  # the module ran once
    saved = torch.load(out, weights_only=True)
    model = Net()
    model.load_state_dict(saved, strict=True)
    for key, value in full.items():
        assert torch.equal(saved[key], value), key


def test_latest_names_the_newest_and_tags_pick_older(tmp_path):
    engine = make_engine(1)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path)
    older = engine.full_state_dict()
    train(engine, 2, 1)
    engine.save_checkpoint(tmp_path)
    engine.close()
    assert (tmp_path / "latest").read_text() == "global_step3"
    other = make_engine(1, seed=3)
    other.load_checkpoint(tmp_path, tag="global_step2")
    assert other.global_steps == 2
    state = other.full_state_dict()
    other.close()
    assert all(torch.equal(state[k], older[k]) for k in older)


def test_weights_only_loads(tmp_path):
    """load_optimizer_states=False takes the weights into an engine with
    another optimizer; load_module_only also leaves the counters."""
    engine = make_engine(2)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path)
    full = engine.full_state_dict()
    engine.close()
    for kwargs, steps in [({"load_optimizer_states": False}, 2), ({"load_module_only": True}, 0)]:
        other = make_engine(3, optimizer="sgd_nesterov", seed=5)
        other.load_checkpoint(tmp_path, **kwargs)
        assert other.global_steps == steps
        assert all(fg.step_count == 0 for fg in other.groups)
        assert all(float(t.abs().max()) == 0 for fg in other.groups for t in fg.states.values())
        state = other.full_state_dict()
        other.close()
        assert all(torch.equal(state[k], full[k]) for k in full)


# ---- refusals: each names what is wrong, and nothing changes --------------------


@pytest.fixture
def saved(tmp_path):
    engine = make_engine(2)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path)
    engine.close()
    return tmp_path


def unchanged_after(engine, action, error, match):
    before = engine.full_state_dict()
    counters = (engine.global_steps, [fg.step_count for fg in engine.groups])
    with pytest.raises(error, match=match):
        action()
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert counters == (engine.global_steps, [fg.step_count for fg in engine.groups])


def test_refuses_other_models(saved):
    torch.manual_seed(0)
    wider = Net()
    wider.head = torch.nn.Linear(16, 51)
    engine = zero.initialize(wider, optimizer=torch.optim.AdamW(wider.parameters()), stage=3)
    unchanged_after(engine, lambda: engine.load_checkpoint(saved), ValueError,
                    r"parameter 'head.weight' has shape \(51, 16\) in the model but "
                    r"\(50, 16\) in the checkpoint")
    engine.close()
    bigger = Net()
    bigger.extra = torch.nn.Linear(2, 2)
    engine = zero.initialize(bigger, optimizer=torch.optim.AdamW(bigger.parameters()), stage=1)
    unchanged_after(engine, lambda: engine.load_checkpoint(saved), ValueError,
                    "the checkpoint has no parameter 'extra.weight' \\(nor 1 more\\)")
    engine.close()
    smaller = Net()
    del smaller.body[3]
    engine = zero.initialize(smaller, optimizer=torch.optim.AdamW(smaller.parameters()))
    unchanged_after(engine, lambda: engine.load_checkpoint(saved), ValueError,
                    "the checkpoint's parameter 'body.3.weight' is not in the model")
    engine.close()


def test_refuses_other_optimizer_states(saved):
    engine = make_engine(1, optimizer="sgd_nesterov", seed=4)
    unchanged_after(engine, lambda: engine.load_checkpoint(saved), ValueError,
                    "holds AdamW states.*SGD; pass load_optimizer_states=False")
    engine.close()
    # an engine that keeps more states than the saved settings use may load
    # (a momentum warm-up saved at 0), if the checkpoint has them all
    engine = make_engine(1, optimizer="adam_amsgrad", seed=4)
    unchanged_after(engine, lambda: engine.load_checkpoint(saved), ValueError,
                    r"the checkpoint has no optimizer state 'max_exp_avg_sq' for parameter")
    engine.close()
    # the other way round: the saved amsgrad=True would replace this
    # optimizer's amsgrad=False, and the next step would find no state for it
    amsgrad = make_engine(1, optimizer="adam_amsgrad")
    train(amsgrad, 0, 1)
    amsgrad.save_checkpoint(saved, tag="amsgrad")
    amsgrad.close()
    engine = make_engine(1, seed=4)
    unchanged_after(engine, lambda: engine.load_checkpoint(saved, tag="amsgrad"), ValueError,
                    r"keep the states \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'\], the "
                    r"engine's optimizer keeps \['exp_avg', 'exp_avg_sq'\]")
    assert engine.optimizer.param_groups[0]["amsgrad"] is False
    engine.close()


def test_a_group_of_other_parameters_is_named(saved):
    """The embedding frozen since the save: its states have no place."""
    torch.manual_seed(4)
    model = Net()
    model.embed.requires_grad_(False)
    opt = make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    engine = zero.initialize(model, optimizer=opt, stage=2)
    unchanged_after(engine, lambda: engine.load_checkpoint(saved), ValueError,
                    r"param group 0 holds other parameters than in the checkpoint \(only in "
                    r"the checkpoint: 'embed.weight'\); pass load_optimizer_states=False")
    engine.load_checkpoint(saved, load_optimizer_states=False)
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_group_frozen_when_saved_starts_afresh_when_unfrozen(tmp_path, stage):
    """Progressive unfreezing through a checkpoint: the first layer in a
    group of its own, frozen for three steps, saved, unfrozen, loaded into
    a new engine. Its group was never trained (no states saved, no step),
    so its states start afresh, as torch's AdamW starts a parameter it
    holds no state for; the other group resumes. Before, the load was
    refused (no optimizer state for '0.weight'), and only
    load_optimizer_states=False, which drops every state, went on
    (mutation hunt). Against torch doing the same in one optimizer: fp32,
    a few ulps apart per step (the C update orders some operations
    otherwise), 1e-6 after six steps."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 4))
    model = copy.deepcopy(ref)

    def optimizer(m):
        return torch.optim.AdamW([{"params": m[0].parameters()},
                                  {"params": [*m[2].parameters(), *m[4].parameters()]}],
                                 lr=1e-2, weight_decay=0.1)
    ref_opt = optimizer(ref)
    for m in (ref, model):
        m[0].requires_grad_(False)
    options = {"stage": stage, "stage3_param_persistence_threshold": 0}
    engine = zero.initialize(model, optimizer=optimizer(model), **options)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]

    def step(x, y):
        ref_opt.zero_grad()
        (ref(x) - y).square().mean().backward()
        ref_opt.step()
        engine.backward((engine(x) - y).square().mean())
        engine.step()
    for x, y in data[:3]:
        step(x, y)
    engine.save_checkpoint(str(tmp_path))
    engine.close()
    for m in (ref, model):
        m[0].requires_grad_(True)
    engine = zero.initialize(model, optimizer=optimizer(model), **options)
    engine.load_checkpoint(str(tmp_path))
    for x, y in data[3:]:
        step(x, y)
    state = engine.full_state_dict()
    for name, p in ref.named_parameters():
        assert (state[name] - p.detach()).abs().max() < 1e-6, name
    assert engine.optimizer.param_groups[0]["weight_decay"] == 0.1
    engine.close()


def test_adamw_stays_decoupled_after_loading_adams_states(tmp_path):
    """A checkpoint of torch.optim.Adam (L2 decay: decoupled_weight_decay
    False in its groups) loaded by an engine of zero.optim.AdamW trains on
    with decoupled decay, as torch.optim.AdamW does after loading Adam's
    state dict (the reference, from the consolidated checkpoint)."""
    torch.manual_seed(0)
    model = Net()
    adam = zero.initialize(model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2,
                                                             weight_decay=0.1), stage=1)
    train(adam, 0, 2)
    adam.save_checkpoint(tmp_path)
    adam.close()
    torch.manual_seed(1)
    model = Net()
    adamw = zero.initialize(model, optimizer=zero.optim.AdamW(model.parameters()), stage=1)
    adamw.load_checkpoint(tmp_path)
    train(adamw, 2, 1)
    reference = Net()
    saved = zero.checkpoint.consolidate(tmp_path)
    reference.load_state_dict(saved["model"])
    opt = torch.optim.AdamW(reference.parameters())
    opt.load_state_dict(saved["optimizer"])
    tokens, targets = batches("cpu", STEPS)[2]
    opt.zero_grad()
    loss_of(reference(tokens), targets).backward()
    opt.step()
    state = adamw.full_state_dict()
    for key, value in reference.state_dict().items():
        assert max_rel_error(state[key], value) <= 1e-6, key
    adamw.close()
    plain = zero.optim.AdamW(reference.parameters())  # zero.optim's own, too
    plain.load_state_dict(saved["optimizer"])
    assert all(g["decoupled_weight_decay"] for g in plain.param_groups)


def test_fresh_optimizer_on_a_trained_engine(saved):
    """load_optimizer_states=False on an engine that has trained: its
    states and step counts start over, and the lr is the restored
    schedule's (step 2 of 1/(1+step)), not the one it had."""
    engine = make_engine(2, seed=4)
    train(engine, 0, 3)
    engine.load_checkpoint(saved, load_optimizer_states=False)
    assert engine.lr_scheduler.last_epoch == 2
    assert [g["lr"] for g in engine.optimizer.param_groups] == [1e-2 * (1 / (1 + 2))]
    assert all(fg.step_count == 0 for fg in engine.groups)
    assert all(float(t.abs().max()) == 0 for fg in engine.groups for t in fg.states.values())
    engine.close()


@pytest.mark.parametrize("stages", [(0, 0), (2, 3)])
def test_an_lr_set_by_hand_survives_a_resume(tmp_path, stages):
    """A rate lowered by hand after the schedule's step (on a plateau) is
    the optimizer's, saved with its groups: a resume keeps it, as torch's
    resume from the optimizer's and the schedule's state dicts keeps it
    (the load put the schedule's last rate over it: one update at 1/0.7
    the rate; a StepLR, which multiplies the group's rate, lost it for
    good). The run goes on as the one that never stopped."""
    whole = make_engine(stages[0])
    train(whole, 0, 1)
    for group in whole.optimizer.param_groups:
        group["lr"] *= 0.7
    train(whole, 1, 2)
    expected, *_ = finish(whole)
    first = make_engine(stages[0])
    train(first, 0, 1)
    for group in first.optimizer.param_groups:
        group["lr"] *= 0.7
    first.save_checkpoint(tmp_path)
    first.close()
    resumed = make_engine(stages[1], seed=3)
    resumed.load_checkpoint(tmp_path)
    assert [g["lr"] for g in resumed.optimizer.param_groups] == pytest.approx([1e-2 * 0.5 * 0.7])
    train(resumed, 1, 2)
    got, *_ = finish(resumed)
    for key, value in expected.items():
        assert max_rel_error(got[key], value) <= 1e-6, key


@pytest.mark.parametrize("optimizer, change", [("sgd_nesterov", {"momentum": 0.0,
                                                                  "nesterov": False}),
                                               ("adam_amsgrad", {"amsgrad": False})])
def test_fresh_optimizer_keeps_states_the_settings_dropped(tmp_path, optimizer, change):
    """Momentum (or amsgrad) switched off since initialize: the state it
    had is still allocated, and a fresh start zeroes it too (it raised a
    KeyError after the weights were already loaded)."""
    engine = make_engine(2, optimizer=optimizer)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path)
    engine.optimizer.param_groups[0].update(change)
    engine.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert all(fg.step_count == 0 for fg in engine.groups)
    assert all(float(t.abs().max()) == 0 for fg in engine.groups for t in fg.states.values())
    engine.close()


def test_a_tag_holding_files_of_two_saves_is_refused(saved):
    """A save into an existing tag that failed after some shards were
    written leaves old and new files side by side: refused, not mixed."""
    folder = saved / "global_step2"
    old_shard = (folder / "zero_shard_00000.pt").read_bytes()
    engine = make_engine(2, seed=4)
    engine.save_checkpoint(saved, tag="global_step2")  # a new save into the same tag
    (folder / "zero_shard_00000.pt").write_bytes(old_shard)
    unchanged_after(engine, lambda: engine.load_checkpoint(saved), ValueError,
                    "belongs to another save than zero_meta.pt")
    engine.close()


def test_consolidated_buffers_are_fp32_like_the_full_state(tmp_path):
    engine = make_engine(1, "bf16")
    engine.module.register_buffer("scale", torch.tensor([0.5, 2.0 / 3.0]))
    engine.module.scale.data = engine.module.scale.to(torch.bfloat16)
    train(engine, 0, 1)
    engine.save_checkpoint(tmp_path)
    full = engine.full_state_dict()
    engine.close()
    model = zero.checkpoint.consolidate(tmp_path)["model"]
    assert model["scale"].dtype == torch.float32 and torch.equal(model["scale"], full["scale"])


def test_refuses_missing_and_foreign_files(saved, tmp_path_factory):
    engine = make_engine(2, seed=4)
    empty = tmp_path_factory.mktemp("empty")
    # no checkpoint at all (a run's first start): (None, None), as DeepSpeed
    before = engine.full_state_dict()
    for nothing in (empty / "nothing", empty):
        with pytest.warns(RuntimeWarning, match="holds no checkpoint yet"):
            assert engine.load_checkpoint(nothing) == (None, None)
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # a file given as the directory, or "", is a mistake, not a first start
    (empty / "weights.bin").write_bytes(b"")
    for wrong in (empty / "weights.bin", ""):
        unchanged_after(engine, lambda: engine.load_checkpoint(wrong), FileNotFoundError,
                        "does not exist")
    (empty / "weights.bin").unlink()
    (empty / "global_step3").mkdir()  # a tag directory, but no latest: which one?
    (empty / "global_step3" / "zero_meta.pt").write_bytes(b"")
    unchanged_after(engine, lambda: engine.load_checkpoint(empty), FileNotFoundError,
                    "latest' does not exist: pass tag=")
    shutil.rmtree(empty / "global_step3")
    unchanged_after(engine, lambda: engine.load_checkpoint(saved, tag="global_step9"),
                    FileNotFoundError, "holds no zero checkpoint")
    unchanged_after(engine, lambda: engine.load_checkpoint(saved, tag="../x"), ValueError,
                    "tag '../x' must be a plain directory name")
    foreign = empty / "foreign"
    foreign.mkdir()
    torch.save({"format": "something else"}, foreign / "zero_meta.pt")
    unchanged_after(engine, lambda: engine.load_checkpoint(empty, tag="foreign"), ValueError,
                    "is not a zero checkpoint")
    shard = saved / "global_step2" / "zero_shard_00000.pt"
    whole = shard.read_bytes()
    for damaged in (whole[:-100], whole[:len(whole) // 2], b""):
        shard.write_bytes(damaged)
        unchanged_after(engine, lambda: engine.load_checkpoint(saved), ValueError,
                        "zero_shard_00000.pt' cannot be read, so it is truncated or damaged")
    os.remove(shard)
    unchanged_after(engine, lambda: engine.load_checkpoint(saved), FileNotFoundError,
                    "zero_shard_00000.pt' is missing")
    engine.close()


def test_refuses_what_it_cannot_save(tmp_path):
    engine = make_engine(2, accumulation=2)
    train(engine, 0, 1, accumulation=2)
    with pytest.raises(TypeError, match=r"client_state\['run'\]\[1\] is a builtins.object"):
        engine.save_checkpoint(tmp_path, client_state={"run": [1, object()]})
    with pytest.raises(ValueError, match="tag 'a/b' must be a plain directory name"):
        engine.save_checkpoint(tmp_path, tag="a/b")
    # the name of the file beside the tags (it failed at the save's last
    # write, after writing the whole checkpoint: a checkpoint hunt)
    with pytest.raises(ValueError, match="tag 'latest' is the name of the file that names"):
        engine.save_checkpoint(tmp_path, tag="latest")
    assert os.listdir(tmp_path) == []
    # into another checkpoint's tag directory: a checkpoint nested there,
    # which loading that tag then read in its place
    other = tmp_path.with_name(tmp_path.name + "_other")
    engine.save_checkpoint(other, tag="x")
    with pytest.raises(ValueError, match=r"save_checkpoint: '.*x' is itself a checkpoint's "
                       r"tag directory .* pass its parent"):
        engine.save_checkpoint(other / "x", tag="y")
    assert not os.path.exists(other / "x" / "y")
    # a tag the save's working directories cannot be named after (it raised
    # the file system's "name too long"), a client_state that holds itself
    # (a RecursionError)
    with pytest.raises(ValueError, match="tag is 250 bytes long; .* use at most 239 bytes"):
        engine.save_checkpoint(tmp_path, tag="t" * 250)
    looped = {"epoch": 1, "steps": [1, 2]}
    looped["steps"].append(looped)
    with pytest.raises(ValueError, match=r"client_state\['steps'\]\[2\] is a container that "
                                         "holds itself"):
        engine.save_checkpoint(tmp_path, client_state=looped)
    shared = [1, 2]  # held twice, but no loop: kept
    engine.save_checkpoint(tmp_path, tag="shared", client_state={"a": shared, "b": shared})
    shutil.rmtree(tmp_path / "shared")
    os.remove(tmp_path / "latest")
    os.remove(tmp_path / "zero_to_fp32.py")  # DeepSpeed's script's place
    assert os.listdir(tmp_path) == []
    # subclasses of the plain types (an IntEnum, a namedtuple, a defaultdict)
    # passed and made a checkpoint that replaced a good one and never loaded
    engine.save_checkpoint(tmp_path, tag="last", client_state={"epoch": 1})
    phase = enum.IntEnum("Phase", "MAIN")
    pair = collections.namedtuple("Pair", "a b")
    for state, refused in (({"phase": phase.MAIN}, r"client_state\['phase'\] is a .*Phase, a "
                                                    r"subclass of int"),
                           ({"p": pair(1, 2)}, r"client_state\['p'\] is a .*Pair, a subclass "
                                               r"of tuple"),
                           (collections.defaultdict(int), "a subclass of dict"),
                           ({phase.MAIN: 1}, "has a key of type Phase")):
        with pytest.raises(TypeError, match=refused):
            engine.save_checkpoint(tmp_path, tag="last", client_state=state)
    # a tag that `latest` would read back stripped, or not a name at all
    for tag, error in ((" sp ", ValueError), ("t\n", ValueError), (b"t", TypeError),
                       (2.0, TypeError)):
        with pytest.raises(error, match="white space or a control|must be a str"):
            engine.save_checkpoint(tmp_path, tag=tag)
    with pytest.raises(TypeError, match="save_dir must be a path, got NoneType"):
        engine.save_checkpoint(None)
    (tmp_path / "a_file").write_text("")  # FileExistsError: [Errno 17] named nothing
    for where in ("a_file", "a_file/below"):
        with pytest.raises(NotADirectoryError, match="it, or a directory above it, is a file"):
            engine.save_checkpoint(tmp_path / where)
    os.remove(tmp_path / "a_file")
    assert sorted(os.listdir(tmp_path)) == ["last", "latest", "zero_to_fp32.py"]
    assert engine.load_checkpoint(tmp_path)[1] == {"epoch": 1}
    # what torch's weights_only load reads back is kept: bool keys, numpy's
    # integers as tags (as DeepSpeed's str(tag)); a tag an earlier version
    # saved with a space at its end still loads by its name
    engine.save_checkpoint(tmp_path, tag=np.int64(7), client_state={True: 3})
    assert engine.load_checkpoint(tmp_path, tag=7)[1] == {True: 3}
    os.rename(tmp_path / "7", tmp_path / "old ")
    assert engine.load_checkpoint(tmp_path, tag="old ")[1] == {True: 3}
    with pytest.raises(FileNotFoundError, match="does not exist .a file of that name does"):
        engine.load_checkpoint(tmp_path / "latest")
    tokens, targets = batches("cpu", 1)[0]
    engine.backward(loss_of(engine(tokens), targets))
    engine.step()  # the first micro-step of two
    with pytest.raises(RuntimeError, match="middle of an accumulation boundary"):
        engine.save_checkpoint(tmp_path)
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_refuses_gradients_waiting_for_a_step(tmp_path, stage):
    """A backward with no step() after it: its gradients would be lost;
    zero_grad() drops them, and then the save goes ahead."""
    engine = make_engine(stage)
    train(engine, 0, 1)
    tokens, targets = batches("cpu", 1)[0]
    engine.backward(loss_of(engine(tokens), targets))
    with pytest.raises(RuntimeError, match="gradients waiting for step"):
        engine.save_checkpoint(tmp_path)
    assert os.listdir(tmp_path) == []
    engine.zero_grad()
    engine.save_checkpoint(tmp_path)
    engine.close()


@pytest.mark.parametrize("stages", [(2, 2), (1, 3)], ids=lambda s: f"{s[0]}to{s[1]}")
def test_a_load_starts_an_accumulation_window_at_another_count(tmp_path, stages):
    """Saved without accumulation after 3 steps, loaded with 2 micro-steps
    per step (a global batch kept on fewer ranks): the next two micro-
    batches make one step, equal (fp32, up to the order of the sums) to
    one step over the two together in an engine without accumulation."""
    save_stage, load_stage = stages
    first = make_engine(save_stage)
    train(first, 0, 3)
    first.save_checkpoint(tmp_path)
    first.close()
    data = batches("cpu", 2, seed=7)
    accumulating = make_engine(load_stage, seed=1, accumulation=2)
    accumulating.load_checkpoint(tmp_path)
    assert not accumulating.is_accumulation_boundary
    for i, (tokens, targets) in enumerate(data):
        accumulating.backward(loss_of(accumulating(tokens), targets))
        accumulating.step()
        assert accumulating.global_steps == 3 + i  # applied at the second only
    whole = make_engine(load_stage, seed=1)
    whole.load_checkpoint(tmp_path)
    tokens, targets = (torch.cat(parts) for parts in zip(*data))
    whole.backward(loss_of(whole(tokens), targets))
    whole.step()
    got, expected = accumulating.full_state_dict(), whole.full_state_dict()
    for key, value in expected.items():
        assert max_rel_error(got[key], value) <= 1e-6, key
    accumulating.save_checkpoint(tmp_path, tag="again")  # at a boundary again
    accumulating.close()
    whole.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_save_16bit_model_loads_into_a_plain_model(tmp_path, stage):
    """DeepSpeed's save_16bit_model: the gathered weights in bf16, for
    model.load_state_dict."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = zero.initialize(model, stage=stage, precision="bf16",
                             stage3_param_persistence_threshold=0)
    engine.backward(engine(torch.randn(4, 6)).float().square().mean())
    engine.step()
    assert engine.save_16bit_model(tmp_path / "out", "sub/weights.bin")  # the folder is made
    full = engine.full_state_dict()
    engine.close()
    saved = torch.load(tmp_path / "out" / "sub" / "weights.bin")
    assert all(v.dtype == torch.bfloat16 for v in saved.values())
    assert all(torch.equal(saved[k], v.to(torch.bfloat16)) for k, v in full.items())
    plain = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.bfloat16)
    plain.load_state_dict(saved)


def _resident_bytes(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))


@pytest.mark.parametrize("stage", [1, 3])
def test_save_16bit_model_holds_about_its_file_not_the_fp32_model(tmp_path, stage):
    """save_16bit_model built the whole fp32 state dict (full_state_dict),
    then its bf16 cast beside it, on every rank: 3-4x the file at its peak
    (beyond-RAM hunt: +7.2 GiB for a 1.8 GiB file at 0.97B parameters,
    stage 3 with the states on a disk). Now each unit is cast as it
    arrives, and the fp32 values held at once are one unit's (stage 3) or
    read in place where this rank holds them whole. Peak resident memory
    over the call, measured (25M parameters, a 48 MiB file): 2.9x and 3.7x
    of the file before, 1.0x and 0.5x after; the bound is 2x."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])
    engine = zero.initialize(model, stage=stage, precision="bf16",
                             stage3_param_persistence_threshold=0)
    engine.backward(engine(torch.randn(4, 1024)).float().square().mean())
    engine.step()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM from here
    start = _resident_bytes("VmRSS")
    engine.save_16bit_model(tmp_path)
    peak = _resident_bytes("VmHWM") - start
    size = (tmp_path / "pytorch_model.bin").stat().st_size
    full = engine.full_state_dict()
    engine.close()
    assert peak < 2 * size, (peak, size)
    saved = torch.load(tmp_path / "pytorch_model.bin")
    assert all(torch.equal(saved[k], v.to(torch.bfloat16)) for k, v in full.items())


def test_load_module_strict_is_deepspeeds_third_argument(saved):
    """engine.load_checkpoint(dir, tag, True), as DeepSpeed scripts write
    it, loads; False is refused with the way to do it."""
    engine = make_engine(2, seed=4)
    path, _ = engine.load_checkpoint(saved, None, True)
    assert path is not None
    with pytest.raises(ValueError, match="load_module_strict=False: only True"):
        engine.load_checkpoint(saved, load_module_strict=False)
    engine.close()


def test_save_16bit_model_keeps_ties_and_buffer_dtypes(tmp_path):
    """A tied embedding is written once (one tensor under both names), and
    buffers in the dtype the module holds them in, as DeepSpeed's file."""
    torch.manual_seed(0)
    emb, norm = nn.Embedding(10, 4), nn.BatchNorm1d(4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, norm, head)
    engine = zero.initialize(model, stage=3, precision="bf16",
                             stage3_param_persistence_threshold=0)
    engine.backward(engine(torch.randint(0, 10, (6,))).float().square().mean())
    engine.step()
    engine.save_16bit_model(tmp_path)
    held = norm.running_mean.dtype  # the engine's (close() gives float32 back)
    engine.close()
    saved = torch.load(tmp_path / "pytorch_model.bin")
    assert saved["0.weight"].dtype == torch.bfloat16
    assert saved["0.weight"].data_ptr() == saved["2.weight"].data_ptr()
    assert saved["1.running_mean"].dtype == held == torch.bfloat16
    assert norm.running_mean.dtype == torch.float32
    assert saved["1.num_batches_tracked"].dtype == torch.int64


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_save_16bit_model_can_leave_the_frozen_parameters_out(tmp_path, stage):
    """An adapter's file (DeepSpeed's exclude_frozen_parameters, the usual
    LoRA save): the trained parameters and the buffers; it was a TypeError
    (a DeepSpeed hunt). The values are the full model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.BatchNorm1d(4), nn.Linear(4, 10))
    model[0].requires_grad_(False)
    engine = zero.initialize(model, stage=stage, precision="bf16",
                             stage3_param_persistence_threshold=0)
    engine.backward(engine(torch.randint(0, 10, (6,))).float().square().mean())
    engine.step()
    engine.save_16bit_model(tmp_path, "adapter.bin", exclude_frozen_parameters=True)
    engine.save_fp16_model(tmp_path, "whole.bin")
    with pytest.raises(TypeError, match="exclude_frozen_parameters must be True or False, got .yes."):
        engine.save_16bit_model(tmp_path, exclude_frozen_parameters="yes")
    engine.close()
    adapter = torch.load(tmp_path / "adapter.bin", weights_only=True)
    whole = torch.load(tmp_path / "whole.bin", weights_only=True)
    assert sorted(adapter) == ["1.bias", "1.num_batches_tracked", "1.running_mean",
                               "1.running_var", "1.weight", "2.bias", "2.weight"]
    assert set(whole) == set(adapter) | {"0.weight"}
    assert all(torch.equal(adapter[k], whole[k]) for k in adapter)


def test_pipeline_stages_meta_keeps_each_groups_step_count():
    """The meta merged from the pipeline stages' parts: a param group whose
    parameters all sit on a later stage counted 0 steps on the first, and
    the merged group took the first stage's count, so a resume restarted
    Adam's bias correction there (review). Each group keeps the count of
    the stages that hold its parameters."""
    from zero.checkpoint._stage_parts import merged_stages

    def part(names, steps, states):
        return {"params": {n: {"shape": [2], "numel": 2, "trainable": True} for n in names},
                "state_dict": [(n, "param", n) for n in names], "buffers": {},
                "extra_states": {},
                "groups": [{"param_names": [n for n in names if n.startswith(g)],
                            "hyper": {"lr": 0.1}, "step": s, "states": st}
                           for g, s, st in zip(("a", "b"), steps, states)]}
    first = part(["a.0"], [7, 0], [["exp_avg"], []])          # group b: none here
    second = part(["a.1", "b.0"], [7, 7], [["exp_avg"], ["exp_avg"]])
    merged = merged_stages([(1, second), (0, first)])
    assert [g["step"] for g in merged["groups"]] == [7, 7]
    assert [g["param_names"] for g in merged["groups"]] == [["a.0", "a.1"], ["b.0"]]
    assert [g["states"] for g in merged["groups"]] == [["exp_avg"], ["exp_avg"]]


@pytest.mark.parametrize("by_engine", [True, False])
def test_numpy_learning_rates_save_and_resume_as_plain_floats(tmp_path, by_engine):
    """A LambdaLR written with numpy makes every lr a numpy.float64 (a float
    subclass); the first save_checkpoint refused it, whether the engine or
    the script stepped the scheduler. Now saved as the float of the same
    value, and the resumed run ends where the uninterrupted one does."""
    def run(first, count, load=False, save=False):
        torch.manual_seed(0)
        model = Net()
        opt = make_optimizer("adamw", model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: 0.5 * (1 + np.cos(np.pi * step / STEPS)))
        engine = zero.initialize(model, optimizer=opt, stage=2,
                                 lr_scheduler=sched if by_engine else None)
        if load:
            engine.load_checkpoint(tmp_path)
            if not by_engine:
                # (the script's own file of numpy floats: torch's weights_only refuses it)
                sched.load_state_dict(torch.load(tmp_path / "sched.pt", weights_only=False))
        data = batches("cpu", STEPS)
        for tokens, targets in data[first:first + count]:
            engine.backward(loss_of(engine(tokens), targets))
            engine.step()
            if not by_engine:
                sched.step()
        assert type(opt.param_groups[0]["lr"]) is np.float64 or load
        if save:
            engine.save_checkpoint(tmp_path)
            torch.save(sched.state_dict(), tmp_path / "sched.pt")
        return finish(engine)
    expected, expected_facts = run(0, STEPS)
    run(0, 3, save=True)
    state, facts = run(3, STEPS - 3, load=True)
    assert facts == expected_facts
    for key, value in expected.items():
        assert torch.equal(state[key], value), key

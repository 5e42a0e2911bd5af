"""The engine in one process with no launcher and no environment variables
(a notebook): API, configs, bad input, re-initialisation."""
import copy
import datetime
import os
import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero
from conftest import max_rel_error


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))


def train_side_by_side(engine, ref, ref_opt, inputs):
    """The same squared-output loss on each input, under the engine and on
    the plain reference model."""
    for x in inputs:
        engine.backward(engine(x).square().mean())
        engine.step()
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    yield
    assert not dist.is_initialized(), "an engine left its process group behind"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_one_matches_torch_with_plain_backward(stage):
    m, ref = model(), model()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                             stage=stage)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        x = torch.randn(4, 6, generator=g)
        engine(x).square().mean().backward()  # plain backward works too
        engine.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        opt.step()
    full = engine.full_state_dict()
    assert list(full) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert max_rel_error(full[k], v) <= 1e-5
    engine.close()


def step_and_match_torch(engine, ref, opt, x):
    """engine.step() beside torch's step on x's loss: the weights agree
    (then the engine closes)."""
    engine.step()
    ref(x).square().mean().backward()
    opt.step()
    full = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        assert max_rel_error(full[k], v) <= 1e-5, k
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_set_by_hand_are_taken_or_refused(stage):
    """torch.autograd.grad, then p.grad = g, then step: stages 0-1 take
    the .grad in (as torch does); stages 2-3 take gradients from backward
    only, and stepped on zeros silently before: refused by name now, with
    nothing changed. (Stage 3 with every unit persistent: a released
    parameter's placeholder refuses the assignment itself.)"""
    m, ref = model(), model()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), stage=stage)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    params = list(m.parameters())
    for p, g in zip(params, torch.autograd.grad(engine(x).square().mean(), params)):
        p.grad = g
    before = engine.full_state_dict()
    if stage >= 2:
        with pytest.raises(RuntimeError, match=rf"parameter '0.weight' has a .grad set outside "
                                               rf"backward .* at stage {stage} the engine takes "
                                               "gradients from backward only"):
            engine.step()
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        engine.zero_grad()
        engine.backward(engine(x).square().mean())  # backward, as the error says
    step_and_match_torch(engine, ref, opt, x)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_frozen_parameters_gradient_set_by_hand_is_refused(stage):
    """A parameter that does not require grad, in the optimizer, given a
    .grad by hand: torch.optim steps it; the engine trains only what
    required grad at initialize, and dropped the gradient silently at every
    stage. Refused by name, nothing changed; without the .grad the step is
    torch's."""
    m, ref = model(), model()
    for net in (m, ref):
        net[0].weight.requires_grad_(False)
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), stage=stage,
                             stage3_param_persistence_threshold=0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x).square().mean())
    before = engine.full_state_dict()
    if stage < 3:  # (a released placeholder refuses a .grad of the weight's shape itself)
        m[0].weight.grad = torch.ones(m[0].weight.shape)
        with pytest.raises(RuntimeError, match="parameter '0.weight' does not require grad but "
                                               "has a .grad \\(set by hand"):
            engine.step()
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        m[0].weight.grad = None  # as the error says
    step_and_match_torch(engine, ref, opt, x)


@pytest.mark.parametrize("stage, options", [
    (1, {}), (1, {"precision": "bf16", "grad_accum_dtype": "fp32"}), (2, {}), (3, {})])
def test_zero_grad_drops_a_gradient_set_by_hand(stage, options):
    """zero_grad() drops a .grad set by hand, as torch's does: where .grad
    is no view of the engine's buffer (stages 2-3, a wider
    grad_accum_dtype) it stayed, and the next backward added to it."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0),
                             stage=stage, stage3_param_persistence_threshold=10**6, **options)
    before = engine.full_state_dict()
    m.bias.grad = torch.full_like(m.bias, 100.0)
    engine.zero_grad()
    engine.backward(engine(torch.randn(3, 4)).float().sum() * 0)  # a zero gradient
    engine.step()
    assert torch.equal(engine.full_state_dict()["bias"], before["bias"])
    engine.close()


@pytest.mark.parametrize("name", ["AdamW", "Lion"])
def test_zero_optim_optimizers_drive_the_engine(name):
    m, ref = model(), model()
    opt = getattr(zero.optim, name)(m.parameters(), lr=1e-2)
    engine = zero.initialize(m, optimizer=opt, stage=2)
    assert opt._segments == [[]] and not opt.state  # its own buffers were freed
    ref_opt = getattr(zero.optim, name)(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    train_side_by_side(engine, ref, ref_opt, [torch.randn(4, 6, generator=g) for _ in range(5)])
    full = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        assert max_rel_error(full[k], v) <= 1e-5, k
    engine.close()


def test_memory_summary_prints_beside_formula():
    m = model()
    engine = zero.initialize(m, optimizer=torch.optim.AdamW(m.parameters()), stage=2,
                             precision="bf16")
    summary = engine.memory_summary()
    text = str(summary)
    assert "formula" in text and "stage 2: 2Ψ + 14Ψ/N" in text
    # 93 parameters in 4 tensors, each starting at a multiple of 64
    # elements: 0, 64, 128, 192, ending at 195, padded to 208 (a multiple of
    # 16): bf16 params and gradient partition, fp32 master, exp_avg, exp_avg_sq
    assert summary["trainable_params"] == 93
    assert (summary["params"], summary["grads"], summary["optimizer_states"]) == \
        (208 * 2, 208 * 2, 208 * 12)
    engine.close()


def test_reinitialize_like_a_rerun_notebook_cell():
    m = model()
    first = zero.initialize(m, optimizer=torch.optim.AdamW(m.parameters()), stage=2)
    second = zero.initialize(m, optimizer=torch.optim.AdamW(m.parameters()), stage=2)
    assert first._closed  # the old engine let go of its hooks and group
    loss = second(torch.randn(2, 6)).sum()
    second.backward(loss)
    second.step()
    second.close()


def test_optimizer_step_is_refused():
    m = model()
    opt = torch.optim.AdamW(m.parameters())
    engine = zero.initialize(m, optimizer=opt, stage=1)
    with pytest.raises(RuntimeError, match="call engine.step"):
        opt.step()
    engine.close()


def test_deepspeed_config_dict_and_file(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e5, "overlap_comm": True,
                              "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                     "warmup_num_steps": 10}},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    for source in (ds, str(path)):
        cfg = zero.Config.from_deepspeed(source)
        assert (cfg.stage, cfg.precision, cfg.gradient_accumulation_steps,
                cfg.reduce_bucket_size) == (1, "bf16", 2, 500000)
    m = model()
    engine = zero.initialize(m, config=ds)
    assert engine.stage == 1 and engine.compute_dtype == torch.bfloat16
    assert isinstance(engine.optimizer, torch.optim.AdamW)
    assert engine.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    lrs = [engine.optimizer.param_groups[0]["lr"]]
    for _ in range(4):  # two boundaries
        engine.backward(engine(torch.randn(4, 6)).float().sum())
        engine.step()
        lrs.append(engine.optimizer.param_groups[0]["lr"])
    # DeepSpeed's WarmupLR: min for the first two updates, then warming up
    assert lrs[0] == lrs[2] == 0.0 and lrs[4] > 0.0
    engine.close()


# ---- bad input: a clear error, nothing half-initialised ----------------------

def untouched(m, before):
    return all(p.data_ptr() == ptr and p.dtype == torch.float32
               for p, ptr in zip(m.parameters(), before))


def test_unknown_config_key_is_named():
    with pytest.raises(ValueError, match="zero_optimization.stagee"):
        zero.Config.from_deepspeed({"zero_optimization": {"stagee": 2}})
    with pytest.raises(ValueError, match="zero does not take: trian_batch_size: not a "
                                         "DeepSpeed key \\(a typo of 'train_batch_size'\\?\\)"):
        zero.Config.from_deepspeed({"trian_batch_size": 8})
    m = model()
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(TypeError, match="unknown option"):
        zero.initialize(m, bucket_size=3)
    assert untouched(m, before)


def test_nested_blocks_as_keywords():
    """loss_scaling= and offload_optimizer= take plain dicts, checked field
    by field (a dict used to pass through unconverted)."""
    config = zero.Config(precision="fp16", loss_scaling={"initial_scale_power": 8})
    assert config.loss_scaling.initial_scale_power == 8
    assert config.loss_scaling.hysteresis == 2
    m = model()
    engine = zero.initialize(m, stage=1, precision="fp16",
                             loss_scaling={"initial_scale_power": 8, "hysteresis": 1})
    assert engine.loss_scaler.scale == 2.0**8
    engine.close()
    with pytest.raises(ValueError, match="loss_scaling has no field 'initial_scale'; its "
                                         "fields are"):
        zero.Config(loss_scaling={"initial_scale": 8})
    with pytest.raises(ValueError, match="loss_scaling must be a dict or a "
                                         "zero.config.LossScaling, got 3"):
        zero.Config(loss_scaling=3)
    for field, value, rule in [("initial_scale_power", -1, "an integer >= 0"),
                               ("loss_scale_window", 0, "an integer >= 1"),
                               ("hysteresis", 1.5, "an integer >= 1"),
                               ("hysteresis", "2", "a finite number"),
                               ("min_loss_scale", -1.0, ">= 0"),
                               ("static_loss_scale", float("inf"), "a finite number")]:
        with pytest.raises(ValueError, match=f"loss_scaling.{field} must be {rule}, got "):
            zero.Config(loss_scaling={field: value})
    # what DeepSpeed configs in the wild write is taken as DeepSpeed takes it
    ds = zero.Config.from_deepspeed({"fp16": {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 16.0, "loss_scale_window": 1e3,
        "hysteresis": 2.0, "min_loss_scale": 1}})
    assert ds.loss_scaling == zero.LossScaling()
    assert type(ds.loss_scaling.initial_scale_power) is int
    # a floor of 0 let NaN steps halve the scale to 0, and the step then
    # divided by it (ZeroDivisionError at step 1075); DeepSpeed refuses it.
    # A static scale or a disabled fp16 block may carry it unused.
    with pytest.raises(ValueError, match="loss_scaling.min_loss_scale .*must be > 0 with "
                                         "dynamic fp16 loss scaling, got 0"):
        zero.Config.from_deepspeed({"fp16": {"enabled": True, "min_loss_scale": 0}})
    zero.Config.from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128,
                                         "min_loss_scale": 0}})
    zero.Config.from_deepspeed({"fp16": {"enabled": False, "min_loss_scale": 0}})
    auto = zero.Config.from_deepspeed({"fp16": {"enabled": True, "loss_scale": "auto",
                                                "initial_scale_power": "auto"}})
    assert auto.precision == "fp16" and auto.loss_scaling == zero.LossScaling()
    with pytest.raises(ValueError, match="fp16.enabled is 'auto', which HuggingFace"):
        zero.Config.from_deepspeed({"fp16": {"enabled": "auto"}})
    # a keyword dict changes those fields of a config file's block, keeps the rest
    merged = zero.Config.from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 8}}) \
        .replace(loss_scaling={"hysteresis": 1})
    assert (merged.loss_scaling.initial_scale_power, merged.loss_scaling.hysteresis) == (8, 1)
    with pytest.raises(ValueError, match="offload_optimizer has no field 'devices'"):
        zero.Config(offload_optimizer={"devices": "nvme"})


@pytest.mark.parametrize("stage", [-1, 4, "2", True, 2.5])
def test_stage_outside_range(stage):
    m = model()
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        zero.initialize(m, stage=stage)
    assert untouched(m, before)


def test_stage_as_an_integral_float():
    assert zero.Config(stage=3.0).stage == 3 and type(zero.Config(stage=3.0).stage) is int


@pytest.mark.parametrize("value", ["1", None, float("nan"), -1])
def test_gradient_clipping_checked(value):
    with pytest.raises(ValueError, match="gradient_clipping must be"):
        zero.Config(gradient_clipping=value)


def test_lr_scheduler_checked():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="lr_scheduler must be a scheduler"):
        zero.initialize(m, optimizer=opt, lr_scheduler=5)
    other = torch.optim.SGD(model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="lr_scheduler was built on another optimizer"):
        zero.initialize(m, optimizer=opt,
                        lr_scheduler=torch.optim.lr_scheduler.StepLR(other, step_size=1))
    # before: a class was kept as the scheduler (step() raised after the
    # update), and a factory that forgot its return meant no schedule
    with pytest.raises(TypeError, match="lr_scheduler is the class StepLR"):
        zero.initialize(m, optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.StepLR)
    with pytest.raises(TypeError, match=r"lr_scheduler\(optimizer\) returned None"):
        zero.initialize(m, optimizer=opt, lr_scheduler=lambda o: None)
    engine = zero.initialize(m, optimizer=opt,
                             lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    engine.backward(engine(torch.randn(2, 6)).sum())
    engine.step()
    assert opt.param_groups[0]["lr"] == 0.05
    engine.close()


def test_sparse_embedding_refused():
    m = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(ValueError, match="module '0' is an Embedding with sparse=True"):
        zero.initialize(m)
    assert untouched(m, before)


class _FunctionalSparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(nn.functional.embedding(ids, self.table, sparse=True))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_sparse_gradient_from_a_forward_is_refused_by_name(stage):
    """F.embedding(sparse=True) inside forward, which initialize cannot see:
    the gradient's arrival at a bucket names the parameter (it was torch's
    "reshape is not implemented for sparse tensors")."""
    torch.manual_seed(0)
    engine = zero.initialize(_FunctionalSparse(), stage=stage)
    with pytest.raises(RuntimeError, match="parameter 'table' got a torch.sparse_coo gradient "
                                           r"\(F.embedding"):
        engine.backward(engine(torch.tensor([1, 2, 2])).sum())
    engine.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_trainable_complex_parameter_is_refused_by_name(stage):
    """It was copied into the real flat buffers: its imaginary part was
    dropped (a warning at stage 0, nothing at stages 2-3) and it trained as
    a real parameter. A frozen one is kept as it is, like an integer one."""
    m = model()
    m[2].phase = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(ValueError, match=r"parameter '2.phase' is complex \(complex64\): zero "
                                         "trains real parameters only"):
        zero.initialize(m, stage=stage)
    assert all(p.data_ptr() == ptr for p, ptr in zip(m.parameters(), before))
    assert m[2].phase.dtype == torch.complex64
    m[2].phase.requires_grad_(False)
    kept = m[2].phase.detach().clone()
    engine = zero.initialize(m, stage=stage)
    engine.backward(engine(torch.randn(2, 6)).square().mean())
    engine.step()
    assert torch.equal(engine.full_state_dict()["2.phase"], kept)
    engine.close()


def test_a_loss_scale_fp32_cannot_hold_is_refused_by_name():
    """2**1000 was taken as the initial fp16 loss scale: inf in fp32, so
    every gradient overflowed and every step was skipped. The bounds are
    fp32's: 2**127 is its largest power of two."""
    assert zero.LossScaling(initial_scale_power=127).initial_scale_power == 127
    for power in (128, 1000):
        with pytest.raises(ValueError, match=rf"loss_scaling.initial_scale_power \(fp16."
                                             rf"initial_scale_power in a DeepSpeed config\) "
                                             rf"must be an integer from 0 to 127, got {power}"):
            zero.Config(precision="fp16", loss_scaling={"initial_scale_power": power})
    with pytest.raises(ValueError, match="fp16.initial_scale_power .* from 0 to 127, got 1000"):
        zero.Config.from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 1000}})
    with pytest.raises(ValueError, match="fp16.initial_scale_power .* from 0 to 127, got 1000"):
        zero.initialize(model(), precision="fp16", loss_scaling={"initial_scale_power": 1000})
    largest = float.fromhex("0x1.fffffep+127")
    assert zero.LossScaling(static_loss_scale=largest).static_loss_scale == largest
    for field, key in (("static_loss_scale", "loss_scale"), ("min_loss_scale", "min_loss_scale")):
        with pytest.raises(ValueError, match=rf"loss_scaling.{field} \(fp16.{key} in a DeepSpeed "
                                             r"config\) must be from 0 to 3.40282346\d*e\+38, "
                                             r"the largest fp32 number, got 1e\+39"):
            zero.Config.from_deepspeed({"fp16": {"enabled": True, key: 1e39}})


@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan"), True, "600", [600],
                                 datetime.timedelta(0), datetime.timedelta(seconds=-1), 1e300,
                                 1e10, datetime.timedelta.max])
def test_timeout_is_checked_by_name(bad):
    m = model()
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(ValueError, match=r"^timeout must be a positive, finite number of seconds "
                                         r"\(from 0.001 to \d+\) or a datetime.timedelta, got "):
        zero.initialize(m, timeout=bad)
    assert untouched(m, before)
    with pytest.raises(ValueError, match="^comms_timeout must be a positive, finite number"):
        zero.Config.from_deepspeed({"comms_timeout": bad})


def test_timeout_is_given_to_the_group_zero_makes():
    """Seconds or a timedelta; left out, 10 minutes (torch's own default
    for gloo is 30). An engine that joins the group later sets it again."""
    from zero.comm import _comm
    assert zero.Config().timeout is None
    assert zero.Config(timeout=datetime.timedelta(minutes=2)).timeout == 120.0
    assert zero.Config.from_deepspeed({"comms_timeout": 45}).timeout == 45.0
    first = zero.initialize(model(), timeout=42)
    assert _comm.group_timeout() == datetime.timedelta(seconds=42)
    second = zero.initialize(model())
    assert _comm.group_timeout() == datetime.timedelta(minutes=10) == _comm.DEFAULT_TIMEOUT
    second.close()
    first.close()


@pytest.mark.parametrize("text", ["Timed out waiting 3000ms for recv operation to complete",
                                  "[pair.cc:1] Application timeout caused pair closure"])
def test_both_of_gloos_timeout_errors_are_named(text):
    """The rank whose wait timed out gets the first; its peer in the pair,
    the second, which was passed on as gloo's bare text."""
    from zero.comm import _comm
    engine = zero.initialize(model(), timeout=42)
    with pytest.raises(RuntimeError, match=r"^zero: all_reduce on a process group zero made "
                                           r"timed out: another rank did not join it within 42"):
        _comm.raise_if_timed_out(RuntimeError(text), "all_reduce")
    _comm.raise_if_timed_out(RuntimeError("Connection closed by peer"), "all_reduce")
    engine.close()


def test_model_without_parameters():
    with pytest.raises(ValueError, match="no parameters"):
        zero.initialize(nn.ReLU())
    frozen = model()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zero.initialize(frozen, optimizer=torch.optim.SGD(frozen.parameters(), lr=0.1))


def test_optimizer_that_cannot_be_partitioned():
    m = model()
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(TypeError, match="RMSprop cannot be partitioned by zero"):
        zero.initialize(m, optimizer=torch.optim.RMSprop(m.parameters()))
    assert untouched(m, before)


def test_a_subclass_with_its_own_step_is_refused():
    """Its step() would never run: the engine runs Adam's update itself. A
    subclass that only adds to __init__ trains as its base."""
    class ClippedAdam(torch.optim.Adam):
        def step(self, closure=None):
            return super().step(closure)

    class Labelled(zero.optim.AdamW):
        def __init__(self, params, label, **kwargs):
            super().__init__(params, **kwargs)
            self.label = label

    m = model()
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(TypeError, match="ClippedAdam defines its own step.*torch.optim.adam.Adam"):
        zero.initialize(m, optimizer=ClippedAdam(m.parameters()))
    assert untouched(m, before)
    engine = zero.initialize(m, optimizer=Labelled(m.parameters(), "run 1"))
    engine.close()

    # what torch does to a class at its first instance when its base had
    # none yet: the base's step, wrapped, in the subclass's own __dict__
    class Wrapped(torch.optim.SGD):
        pass
    Wrapped.step = torch.optim.Optimizer.profile_hook_step(torch.optim.SGD.step)
    engine = zero.initialize(m, optimizer=Wrapped(m.parameters(), lr=0.1))
    engine.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_group_the_update_refuses_leaves_the_step_unapplied(stage):
    """torch.optim.SGD checks nesterov only when built; set later on the
    second group, the step refuses before the first group is updated, and
    goes ahead once the setting is mended."""
    m = model()
    opt = torch.optim.SGD([{"params": m[0].parameters()}, {"params": m[2].parameters()}],
                          lr=0.1, momentum=0.9)
    engine = zero.initialize(m, optimizer=opt, stage=stage)
    x = torch.randn(4, 6)
    engine.backward(engine(x).square().mean())
    engine.step()
    before = engine.full_state_dict()
    engine.backward(engine(x).square().mean())
    opt.param_groups[1].update(nesterov=True, dampening=0.1)
    with pytest.raises(ValueError, match="param group 1: nesterov=True needs momentum > 0 "
                                         "and dampening 0; nothing was updated"):
        engine.step()
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert [fg.step_count for fg in engine.groups] == [1, 1]
    assert (engine.global_steps, engine.micro_steps) == (1, 1)
    opt.param_groups[1]["dampening"] = 0.0
    engine.step()
    assert [fg.step_count for fg in engine.groups] == [2, 2] and engine.global_steps == 2
    engine.close()


@pytest.mark.parametrize("setting, error, message", [
    ({"lr": "0.01"}, TypeError, "lr is '0.01' \\(str\\); it must be a number"),
    ({"betas": (0.9, None)}, TypeError, "betas is None \\(NoneType\\)"),
    ({"differentiable": True}, ValueError, "differentiable=True: zero updates the parameters "
                                           "outside autograd"),
])
def test_a_setting_the_update_cannot_honour_is_refused_by_name(setting, error, message):
    """float() took an lr of "0.01" (torch's step refuses it), and
    differentiable=True gave a step no gradient flows through, silently."""
    m = model()
    opt = torch.optim.AdamW([{"params": m[0].parameters()}, {"params": m[2].parameters()}])
    engine = zero.initialize(m, optimizer=opt, stage=2)
    before = engine.full_state_dict()
    engine.backward(engine(torch.randn(4, 6)).square().mean())
    opt.param_groups[1].update(setting)
    with pytest.raises(error, match=f"param group 1: {message}.*nothing was updated"):
        engine.step()
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    opt.param_groups[1].update({k: opt.defaults[k] for k in setting})
    opt.param_groups[1]["lr"] = torch.tensor(1e-3)  # torch's optimizers take a tensor lr
    engine.step()
    assert engine.global_steps == 1
    engine.close()
    # set before initialize: refused there, not after the first forward and backward
    opt.param_groups[1].update(setting)
    with pytest.raises(error, match=f"^optimizer param group 1: {message}"):
        zero.initialize(m, optimizer=opt, stage=2)


def test_parameters_that_share_memory_are_refused_by_name():
    """Two Parameters over one tensor: torch's SGD gives each both
    gradients (-2), the engine's flat buffers split them (-1 each)."""
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            shared = torch.zeros(2)
            self.c, self.d = nn.Parameter(shared), nn.Parameter(shared)

        def forward(self, x):
            return x * self.c + x * self.d

    m = Twice()
    with pytest.raises(ValueError, match="parameter 'c' and parameter 'd' share memory .*Tie "
                                         "them as one Parameter"):
        zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0), stage=1)
    m.d = m.c  # tied: one parameter
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0), stage=1)
    engine.backward(engine(torch.ones(2)).sum())
    engine.step()
    engine.close()
    assert m.c.tolist() == [-2.0, -2.0]


@pytest.mark.parametrize("stage", [0, 3])
def test_an_expanded_buffer_is_refused_in_one_process_before_any_change(stage):
    """A buffer whose elements share memory (stride 0) was refused on
    several ranks only; in one process it trained and saved, then
    load_checkpoint failed on torch's unnamed error after the parameters
    had taken the checkpoint's values (docs hunt). Now refused by name in
    one process too, before the model is cast."""
    model = nn.Linear(4, 4)
    model.register_buffer("e", torch.ones(1).expand(4))
    with pytest.raises(ValueError, match=r"buffer 'e' has elements that share memory \(an "
                                         r"expanded tensor, strides \(0,\)\)"):
        zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        stage=stage, precision="bf16")
    assert model.weight.dtype == torch.float32 and isinstance(model.weight, nn.Parameter)
    model.e = model.e.contiguous()
    zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    stage=stage, precision="bf16").close()


@pytest.mark.parametrize("stage", [0, 3])
def test_an_expanded_parameter_is_refused_by_name(stage):
    """A Parameter over an expanded tensor (stride 0): torch's optimizers
    refuse it; laid out flat, its 64 elements trained as 64 values, which
    the model then held apart (interop hunt). Frozen, it stays as it is."""
    model = nn.Linear(8, 8)
    model.w = nn.Parameter(torch.randn(8, 1).expand(8, 8))
    with pytest.raises(ValueError, match=r"parameter 'w' has elements that share memory \(an "
                                         r"expanded tensor, strides \(1, 0\)\)"):
        zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        stage=stage)
    model.w.requires_grad_(False)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.1), stage=stage)
    engine.close()


def test_parameter_missing_from_optimizer_is_named():
    m = model()
    with pytest.raises(ValueError, match="parameter '2.weight' requires grad but is in none"):
        zero.initialize(m, optimizer=torch.optim.SGD([m[0].weight, m[0].bias, m[2].bias],
                                                     lr=0.1))


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_listed_twice_in_the_groups_is_refused_by_name(stage):
    """A parameter in two param groups (appended after the optimizer was
    built), or twice in one: torch.optim updates it once per listing, each
    with its group's lr; the engine kept the first listing only and
    trained it with 0.1 where torch applied 0.1 + 0.001, silently
    (notebook hunt). Refused by name; the model is left as it was."""
    m = model()
    opt = torch.optim.SGD([{"params": list(m[0].parameters()), "lr": 0.1},
                           {"params": list(m[2].parameters()), "lr": 0.001}])
    opt.param_groups[1]["params"].append(m[0].weight)
    with pytest.raises(ValueError, match=r"parameter '0.weight' is listed in param groups 0 "
                                         r"and 1 of the optimizer"):
        zero.initialize(m, optimizer=opt, stage=stage)
    assert isinstance(m[0].weight, nn.Parameter) and m[0].weight.shape == (9, 6)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt.param_groups[0]["params"].append(m[2].bias)
    with pytest.raises(ValueError, match=r"parameter '2.bias' is listed twice in param "
                                         r"group 0"):
        zero.initialize(m, optimizer=opt, stage=stage)
    frozen = model()
    frozen[2].bias.requires_grad_(False)  # a frozen one listed twice trains in neither
    opt = torch.optim.SGD(frozen.parameters(), lr=0.1)
    opt.param_groups[0]["params"].append(frozen[2].bias)
    zero.initialize(frozen, optimizer=opt, stage=stage).close()


def test_no_sync_refused_at_stage_2_with_advice_that_works():
    m, ref = model(), model()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), stage=2)
    with pytest.raises(RuntimeError, match="no_sync.. cannot be used with stage 2.*leave "
                       "no_sync.. out: backward.. several times, then step.., sums"):
        with engine.no_sync():
            pass
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(5))
    for x in batches:  # the advice, followed: three backwards, one step
        engine.backward(engine(x).square().sum())
        ref(x).square().sum().backward()
    engine.step()
    opt.step()
    for (name, ours), theirs in zip(engine.full_state_dict().items(), ref.parameters()):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), name
    engine.close()


def test_clip_grad_norm_returns_the_global_norm_and_clips():
    m, ref = model(), model()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), stage=2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    engine.backward(engine(x).square().sum())
    norm = engine.clip_grad_norm_(0.01)
    ref(x).square().sum().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert abs(norm - ref_norm.item()) <= 1e-5 * ref_norm.item()
    engine.step()
    opt.step()
    full = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        assert max_rel_error(full[k], v) <= 1e-5, k
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        engine.clip_grad_norm_(0.0)
    engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_sgd_momentum_warm_up_from_zero_starts_the_buffer_as_torch(stage, tmp_path):
    """momentum 0 on the first update, 0.9 after, with dampening: torch
    starts the buffer as the gradient at the first update that uses it.
    The engine started it at the group's first update, and the second
    update then took (1 - dampening) g: 0.5 off. A checkpoint saved
    before the buffer started, loaded, and consolidated, goes on the same."""
    m, ref = model(), model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    engine = zero.initialize(m, optimizer=opt, stage=stage)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    g = torch.Generator().manual_seed(5)
    for update in range(4):
        for o in (opt, ref_opt):
            o.param_groups[0]["momentum"] = 0.0 if update == 0 else 0.9
        train_side_by_side(engine, ref, ref_opt, [torch.randn(4, 6, generator=g)])
        if update == 0:
            engine.save_checkpoint(tmp_path)
            saved = zero.checkpoint.consolidate(tmp_path)["optimizer"]
            assert all("momentum_buffer" not in s for s in saved["state"].values())
            engine.close()
            m = model()
            opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
            engine = zero.initialize(m, optimizer=opt, stage=stage)
            engine.load_checkpoint(tmp_path)
    engine.close()
    for p, q in zip(m.parameters(), ref.parameters()):  # fp32: ulps over 4 updates
        assert max_rel_error(p.detach(), q.detach()) <= 1e-5
        assert max_rel_error(opt.state[p]["momentum_buffer"],
                             ref_opt.state[q]["momentum_buffer"]) <= 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_adagrad_starts_every_sum_at_the_constructors_value_as_torch(stage, tmp_path):
    """torch's Adagrad fills each sum at construction with the
    constructor's initial_accumulator_value; a param group's own value
    is never used. The engine took the group's: 0.036 off after 3 updates.
    A load with load_optimizer_states=False starts them the same way."""
    def adagrad(net):
        return torch.optim.Adagrad([{"params": net[0].parameters()},
                                    {"params": net[2].parameters(),
                                     "initial_accumulator_value": 0.5}],
                                   lr=0.1, initial_accumulator_value=0.1)
    m, ref = model(), model()
    opt, ref_opt = adagrad(m), adagrad(ref)
    engine = zero.initialize(m, optimizer=opt, stage=stage)
    # the sums torch made at construction went (a whole fp32 copy of the
    # model on every rank, 4Ψ bytes no figure counted, stayed before)
    assert len(opt.state) == 0
    engine.save_checkpoint(tmp_path)
    engine.load_checkpoint(tmp_path, load_optimizer_states=False)
    g = torch.Generator().manual_seed(6)
    train_side_by_side(engine, ref, ref_opt, [torch.randn(4, 6, generator=g) for _ in range(3)])
    engine.close()
    for p, q in zip(m.parameters(), ref.parameters()):  # fp32: ulps over 3 updates
        assert max_rel_error(p.detach(), q.detach()) <= 1e-5
        assert max_rel_error(opt.state[p]["sum"], ref_opt.state[q]["sum"]) <= 1e-5


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_scale_wrt_gas_false_keeps_that_losss_gradient_whole(stage):
    """DeepSpeed's backward(loss, scale_wrt_gas=False): that micro-batch's
    gradient is not divided by the accumulation count. Three micro-batches,
    the second one whole: torch's SGD on g1/3 + g2 + g3/3. In fp16 the
    same as multiplying that loss by 3 oneself, bit for bit (the loss
    scale and its overflow skips included). The argument was refused
    before (a TypeError for an unknown keyword)."""
    def run(precision, whole_by_argument):
        m = model()
        scaling = {"initial_scale_power": 8} if precision == "fp16" else None
        engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                 stage=stage, precision=precision,
                                 gradient_accumulation_steps=3, loss_scaling=scaling)
        g = torch.Generator().manual_seed(8)
        for _update in range(2):
            for micro in range(3):
                loss = engine(torch.randn(4, 6, generator=g)).square().mean()
                if micro != 1:
                    engine.backward(loss)
                elif whole_by_argument:
                    engine.backward(loss, scale_wrt_gas=False)
                else:
                    engine.backward(loss * 3)
                engine.step()
        assert engine.global_steps == 2  # no overflow skipped one
        engine.close()
        return m

    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(8)
    for _update in range(2):
        for micro in range(3):
            (ref(torch.randn(4, 6, generator=g)).square().mean() / (1 if micro == 1 else 3)
             ).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(run("fp32", True).parameters(), ref.parameters()):  # fp32: ulps
        assert max_rel_error(p.detach(), q.detach()) <= 1e-5
    for p, q in zip(run("fp16", True).parameters(), run("fp16", False).parameters()):
        assert torch.equal(p, q)
    with pytest.raises(TypeError, match="scale_wrt_gas must be True or False, got 'no'"):
        zero.initialize(model(), stage=1).backward(torch.zeros(()), scale_wrt_gas="no")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_gives_torchs_norm(bad):
    """torch's clip_grad_norm_ reports NaN for a NaN gradient (we said
    inf); the clipped update zeroes the other gradients (docs/engine.md)."""
    m, ref = model(), model()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), stage=0,
                             gradient_clipping=1.0)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    engine.backward(engine(x).square().sum())
    ref(x).square().sum().backward()
    m[0].bias.grad[1] = ref[0].bias.grad[1] = bad  # stage 0: views of the flat gradients
    torch_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
    before = engine.full_state_dict()
    engine.step()
    norm = engine.get_global_grad_norm()
    assert (math.isnan(norm), math.isinf(norm)) == (math.isnan(torch_norm), math.isinf(torch_norm))
    after = engine.full_state_dict()
    assert math.isnan(after["0.bias"][1])
    assert all(torch.equal(after[k], v) for k, v in before.items() if k != "0.bias")
    engine.close()


def test_stage3_releases_parameters_and_close_restores_them():
    m, ref = model(), model()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), stage=3,
                             stage3_param_persistence_threshold=0)
    # outside forward a released parameter is an empty placeholder
    assert m[0].weight.shape == (0,)
    with zero.GatheredParameters(m[0].weight):
        assert torch.equal(m[0].weight, ref[0].weight)
    assert m[0].weight.shape == (0,)
    engine.close()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_stage3_reinitialize_like_a_rerun_notebook_cell():
    m = model()
    first = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), stage=3,
                            stage3_param_persistence_threshold=0)
    first.backward(first(torch.randn(2, 6)).sum())
    first.step()
    trained = first.full_state_dict()
    second = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), stage=3)
    again = second.full_state_dict()
    assert all(torch.equal(trained[k], again[k]) for k in trained)
    second.close()


@pytest.mark.parametrize("key,value", [("stage3_param_persistence_threshold", -1),
                                       ("stage3_prefetch_bucket_size", 1.5),
                                       ("stage3_max_live_parameters", True)])
def test_stage3_options_are_checked(key, value):
    with pytest.raises(ValueError, match=key):
        zero.Config(**{key: value})


def test_gathered_parameters_bad_modifier_rank():
    m = model()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), stage=3)
    with pytest.raises(ValueError, match="modifier_rank 1"):
        with zero.GatheredParameters(m[0].weight, modifier_rank=1):
            pass
    with pytest.raises(TypeError, match="modifier_rank"):
        zero.GatheredParameters(m[0].weight, modifier_rank="0")
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_unused_module_does_not_hold_back_later_buckets(stage):
    """A module unused on every step (BERT's pooler under masked-LM): from
    the second step on, buckets after it leave as they fill instead of all
    waiting for the end of the backward (see [Note: expected gradients])."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
            self.pooler = nn.Linear(64, 64)
            self.head = nn.Linear(64, 4)

        def forward(self, x):
            return self.head(self.layers(x))

    torch.manual_seed(0)
    net = Net()
    engine = zero.initialize(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                             stage=stage, stage3_param_persistence_threshold=0,
                             reduce_bucket_size=64 * 64 + 64)
    peaks = []
    for _ in range(3):
        for fg in engine.groups:
            fg.reducer.peak_bucket_bytes = 0
        engine.backward(engine(torch.randn(4, 64)).sum())
        engine.step()
        peaks.append(engine.memory_summary()["buckets"])
    layer = (64 * 64 + 64) * 4
    assert peaks[0] > 6 * layer   # first step: everything waits for the pooler
    assert peaks[1] <= 3 * layer and peaks[2] <= 3 * layer, peaks
    engine.close()


class Positions(nn.Module):
    """Returns a view of its own parameter, as learned position embeddings do."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 6))

    def forward(self, n):
        return self.table[:n]


class WithPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = Positions()
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(x + self.pos(x.shape[0]))


def released_pair(cls):
    """A model, its plain twin, and a stage-3 engine (SGD, every unit
    released after use) on the model."""
    torch.manual_seed(0)
    m, ref = cls(), cls()
    ref.load_state_dict(m.state_dict())
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), stage=3,
                             stage3_param_persistence_threshold=0)
    return m, ref, engine


def test_stage3_output_that_views_a_released_parameter():
    m, ref, engine = released_pair(WithPositions)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    train_side_by_side(engine, ref, torch.optim.SGD(ref.parameters(), lr=0.1), [x] * 3)
    state = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7)
    engine.close()


class Boom(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if Boom.armed:
            raise RuntimeError("boom")
        return grad


class BoomLayer(nn.Module):
    def forward(self, x):
        return Boom.apply(x)


@pytest.mark.parametrize("stage", [2, 3])
def test_recovers_from_a_backward_that_raised(stage):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 9), BoomLayer(), nn.Linear(9, 3))
    m, ref = build(), build()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                             stage=stage, stage3_param_persistence_threshold=0,
                             reduce_bucket_size=30)
    x = torch.randn(4, 6)
    Boom.armed = True
    with pytest.raises(RuntimeError, match="boom"):
        # the last layer's backward runs (and reduces) before the raise
        engine.backward(engine(x).square().mean())
    Boom.armed = False
    assert engine._schedule.in_backward if stage == 3 else engine.groups[0].reducer.backward_started
    engine.zero_grad()
    engine.backward(engine(x).square().mean())
    engine.step()
    if stage == 3:
        assert not any(u.gathered for fg in engine.groups for u in fg.units)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).square().mean().backward()
    opt.step()
    state = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7)
    engine.close()


class ParentReadsChildWeight(nn.Module):
    """The parent uses its child's weight directly: an external parameter."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 5)
        self.bias = nn.Parameter(torch.zeros(6))

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        return torch.nn.functional.linear(h, self.embed.weight.t(), self.bias)


@pytest.mark.parametrize("registered", [True, False])
def test_stage3_external_parameter(registered):
    """Registered, or found as the forward reads it by attribute ([Note:
    parameters read by attribute]; the read found the placeholder)."""
    m, ref, engine = released_pair(ParentReadsChildWeight)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    if registered:
        engine.register_external_parameter(m, m.embed.weight)
    train_side_by_side(engine, ref, torch.optim.SGD(ref.parameters(), lr=0.1), [x] * 3)
    state = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="not a module of the wrapped model"):
        engine.register_external_parameter(nn.Linear(2, 2), m.embed.weight)
    engine.close()


def test_closing_one_engine_leaves_the_group_another_engine_uses():
    first_model, second_model = model(0), model(1)
    first = zero.initialize(first_model, optimizer=torch.optim.SGD(first_model.parameters(),
                                                                   lr=0.1))
    second = zero.initialize(second_model, stage=2,
                             optimizer=torch.optim.SGD(second_model.parameters(), lr=0.1))
    first.close()
    assert dist.is_initialized()
    second.backward(second(torch.randn(4, 6)).square().mean())
    second.step()
    assert second.global_steps == 1 and dist.is_initialized()
    second.close()
    assert not dist.is_initialized()  # the last engine out destroys it


def _accumulated_update(stage, grad_accum_dtype, micro_batches=16):
    """(the engine's update of the fp32 masters, the exact one) after one
    SGD step over micro_batches bf16 backwards: SGD so that the update is
    the averaged gradient itself, which the comparison then sees bare."""
    m, twin = model(3), model(3).to(torch.bfloat16)
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0), stage=stage,
                             precision="bf16", gradient_accumulation_steps=micro_batches,
                             grad_accum_dtype=grad_accum_dtype,
                             stage3_param_persistence_threshold=0)
    before = engine.full_state_dict()
    sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in twin.named_parameters()}
    g = torch.Generator().manual_seed(4)
    for _ in range(micro_batches):
        x = torch.randn(4, 6, generator=g)
        engine.backward(engine(x).float().square().mean())
        engine.step()
        twin.zero_grad()
        twin(x.to(torch.bfloat16)).float().square().mean().backward()
        for n, p in twin.named_parameters():
            sums[n] += p.grad.float()  # the same bf16 gradients, summed exactly in fp32
    after = engine.full_state_dict()
    summary = engine.memory_summary()
    engine.close()
    ours = torch.cat([(before[n] - after[n]).reshape(-1) for n in sums])
    exact = torch.cat([(s * (1.0 / micro_batches)).reshape(-1) for s in sums.values()])
    return ours, exact, summary


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_gradient_accumulation_sums_bf16_micro_batches_exactly(stage):
    ours, exact, summary = _accumulated_update(stage, "fp32")
    # what remains is the rounding of the update of fp32 masters (2^-24)
    assert max_rel_error(ours, exact) <= 1e-5
    bf16_ours, bf16_exact, bf16_summary = _accumulated_update(stage, None)
    assert torch.equal(bf16_exact, exact)
    # summed in bf16 (8 mantissa bits) the same update is visibly off
    assert max_rel_error(bf16_ours, bf16_exact) >= 1e-4
    assert summary["grads"] == 2 * bf16_summary["grads"]  # the partition in fp32
    # SGD keeps the fp32 master only: 4 bytes of optimizer state
    assert ["(2+4+4)Ψ", "6Ψ + 4Ψ/N", "2Ψ + 8Ψ/N", "(2+4+4)Ψ/N"][stage] in summary["formula"]


def test_grad_accum_dtype_is_checked():
    with pytest.raises(ValueError, match="grad_accum_dtype must be"):
        zero.Config(stage=2, precision="bf16", grad_accum_dtype="fp16")
    cfg = zero.Config.from_deepspeed({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                                      "data_types": {"grad_accum_dtype": "fp32"}})
    assert cfg.grad_accum_dtype == "fp32"


class _Adapted(nn.Module):
    """A frozen base layer with a trainable low-rank adapter beside it, as
    LoRA fine-tuning makes every layer of a model."""

    def __init__(self, width=64, rank=4):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.up(self.down(x)))


def _adapted_model(seed=0, layers=6):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), *[_Adapted() for _ in range(layers)],
                         nn.Linear(64, 1))


def test_stage3_frozen_base_layers_are_released_during_backward():
    """The frozen base layers' units go as soon as their module's backward
    is over, not at the end of the backward: the gathered peak stays a few
    units, where holding them to the end would gather all six."""
    m, ref = _adapted_model(), _adapted_model()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(
        [p for p in m.parameters() if p.requires_grad], lr=0.1), stage=3,
        stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(5)
    train_side_by_side(engine, ref, ref_opt, [torch.randn(4, 8, generator=g) for _ in range(3)])
    base_unit = engine.frozen_group.units[0].total  # one 64x64 base layer, padded
    peak = engine.memory_summary()["gathered_peak"] // 4  # fp32 elements
    assert peak <= 3 * base_unit, (peak, base_unit)
    full = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        assert max_rel_error(full[k], v) <= 1e-5, k
    engine.close()


def test_deepspeed_engine_queries():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    engine = zero.initialize(m, optimizer=opt, stage=1, precision="bf16",
                             gradient_accumulation_steps=2, train_micro_batch_size_per_gpu=3)
    assert (engine.zero_optimization_stage(), engine.gradient_accumulation_steps(),
            engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()) == (1, 2, 3, 6)
    assert engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert (engine.world_size, engine.global_rank) == (1, 0)
    assert engine.get_lr() == [0.1]
    assert engine.local_rank == 0 and engine.global_samples == 0
    assert not engine.is_gradient_accumulation_boundary() and not engine.was_step_applied()
    engine.backward(engine(torch.randn(3, 6)).float().sum())
    engine.step()
    # DeepSpeed's meaning: the last step() call updated nothing yet
    assert engine.is_gradient_accumulation_boundary() and not engine.was_step_applied()
    engine.backward(engine(torch.randn(3, 6)).float().sum())
    engine.step()
    assert engine.was_step_applied() and engine.skipped_steps == 0 and engine.global_steps == 1
    assert engine.global_samples == 6
    engine.close()


@pytest.mark.parametrize("bad", ["nan input", "loss times 1e30"])
@pytest.mark.parametrize("check", [True, False])
def test_bf16_check_grad_overflow_skips_a_nonfinite_step(check, bad):
    """DeepSpeed's bf16.check_grad_overflow: a step whose gradients hold a
    nan is skipped (weights and states untouched); without it the step is
    taken and the weights go nan, as in torch. So is one whose gradient
    norm's square overflows fp32 (the core sums squares in double: such a
    step was taken, Adam's second moments became inf, and the weights never
    moved again)."""
    m = model()
    config = {"bf16": {"enabled": True, "check_grad_overflow": check},
              "zero_optimization": {"stage": 2}}
    engine = zero.initialize(m, optimizer=torch.optim.AdamW(m.parameters(), lr=0.1),
                             config=config)
    before = engine.full_state_dict()
    x = torch.randn(3, 6)
    if bad == "nan input":
        x[0, 0] = float("nan")
    engine.backward(engine(x).float().sum() * (1e30 if bad == "loss times 1e30" else 1.0))
    engine.step()
    after = engine.full_state_dict()
    finite = all(bool(v.isfinite().all()) for v in after.values())
    # unchecked, the huge step is taken, clipped to norm 1 (the config's
    # gradient_clipping), so it stays finite
    assert (engine.was_step_applied(), engine.skipped_steps, finite) == \
        ((False, 1, True) if check else (True, 0, bad != "nan input"))
    if check:
        assert all(torch.equal(before[k], after[k]) for k in before)
        # a skipped step's nan norm reads inf, as DeepSpeed's, so a script
        # counting overflows with isinf sees it (a DeepSpeed hunt)
        assert engine.get_global_grad_norm() > 1e30 if bad != "nan input" else \
            engine.get_global_grad_norm() == float("inf")
        engine.backward(engine(torch.randn(3, 6)).float().sum())
        engine.step()  # the next good batch steps
        assert engine.was_step_applied() and engine.global_steps == 1
    engine.close()


def test_fp16_with_plain_backward_is_refused():
    """loss.backward() skips the loss scale that step() divides out: the
    update would be 2^16 times too small, silently."""
    m = model()
    engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                             precision="fp16")
    engine(torch.randn(3, 6)).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"fp16: step\(\) needs an engine.backward\(loss\)"):
        engine.step()
    engine.zero_grad()
    engine.backward(engine(torch.randn(3, 6)).float().sum())
    engine.step()  # taken, or skipped on an overflow at the first scale: counted either way
    assert engine.global_steps + engine.skipped_steps == 1
    engine.close()


MASTER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
OTHER_LAUNCHERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE",
                   "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")


@pytest.mark.parametrize("env, match", [
    ({"RANK": "0", "WORLD_SIZE": "2"},
     r"launcher variables RANK, WORLD_SIZE are set but MASTER_ADDR, MASTER_PORT are not"),
    # without WORLD_SIZE: a rank other than 0 is one of several
    ({"RANK": "1"}, r"launcher variables RANK are set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
    ({"RANK": "1", **MASTER}, r"MASTER_PORT are set but WORLD_SIZE is not"),
    # launchers zero does not read ranks from ([Note: launcher environment])
    ({"OMPI_COMM_WORLD_SIZE": "4", **MASTER}, r"one of 4 that mpirun \(OpenMPI\) started .*"
                                              r"not set, so each would train alone"),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}, r"one of 2 that srun started"),
], ids=["no master", "rank alone", "no world size", "mpirun", "srun"])
def test_a_half_set_launcher_environment_names_what_is_missing(monkeypatch, env, match):
    for var in OTHER_LAUNCHERS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(RuntimeError, match=match):
        zero.initialize(model())
    assert not dist.is_initialized()


@pytest.mark.parametrize("env", [MASTER, {"SLURM_NTASKS": "4"}, {"OMPI_COMM_WORLD_SIZE": "1"},
                                 {"RANK": "0"}, {"SLURM_STEP_NUM_TASKS": "4", "WORLD_SIZE": "1"}],
                         ids=["master exported", "sbatch allocation", "mpirun -n 1", "rank 0",
                              "srun sweep alone"])
def test_a_lone_process_under_launcher_leftovers_trains_as_one(monkeypatch, env):
    """Variables that say nothing about other processes (exported in a
    shell, a batch script's allocation) leave a world of this process."""
    for var in OTHER_LAUNCHERS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    engine = zero.initialize(model(), optimizer=None, stage=1)
    assert engine.world_size == 1
    engine.close()


def test_floating_inputs_inside_containers_are_cast(no_launcher):
    """engine(...) casts floating inputs to the compute dtype inside dicts,
    lists, tuples, namedtuples and PackedSequences too (only top-level
    ones were: a dict of fp32 features met bf16 weights); integer tensors
    and other objects pass as they are."""
    import collections

    from torch.nn.utils.rnn import pack_padded_sequence
    Pair = collections.namedtuple("Pair", "a b")
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, inputs, extra=None):
            seen.append((inputs, extra))
            return self.lin(inputs["x"]).sum() + self.lin(inputs["more"][0]).sum()

    engine = zero.initialize(Probe(), stage=2, precision="bf16")
    ids = torch.arange(3)
    packed = pack_padded_sequence(torch.randn(2, 3, 4), torch.tensor([3, 2]),
                                  batch_first=True)
    engine({"x": torch.randn(2, 4), "more": [torch.randn(2, 4), ids]},
           extra=(Pair(torch.randn(1), ids), packed, "text"))
    inputs, (pair, cast_packed, text) = seen[0]
    assert inputs["x"].dtype == inputs["more"][0].dtype == torch.bfloat16
    assert inputs["more"][1].dtype == torch.int64
    assert type(pair) is Pair and pair.a.dtype == torch.bfloat16 and pair.b is ids
    assert type(cast_packed) is type(packed) and cast_packed.data.dtype == torch.bfloat16
    assert torch.equal(cast_packed.batch_sizes, packed.batch_sizes) and text == "text"
    engine.close()


def test_flags_and_numbers_of_the_calls_are_checked_by_type(tmp_path):
    """By Python's truth "no" meant yes (save_latest="no" rewrote latest,
    load_optimizer_states="no" loaded the optimizer); a float loss or a
    string max_norm failed deep inside with an error naming neither."""
    engine = zero.initialize(model(), stage=1)
    engine.backward(engine(torch.randn(2, 6)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path, tag="first")
    calls = [(lambda: engine.backward(1.0), "loss must be a torch.Tensor, got float"),
             (lambda: engine.clip_grad_norm_("1.0"), "max_norm must be a number > 0"),
             (lambda: engine.save_checkpoint(tmp_path, tag="second", save_latest="no"),
              "save_latest must be True or False"),
             (lambda: engine.load_checkpoint(tmp_path, load_optimizer_states="no"),
              "load_optimizer_states must be True or False"),
             (lambda: engine.load_checkpoint(tmp_path, load_module_only=1),
              "load_module_only must be True or False"),
             (lambda: zero.checkpoint.consolidate(tmp_path, with_optimizer="no"),
              "with_optimizer must be True or False"),
             (lambda: zero.GatheredParameters(list(engine.module.parameters()), enabled="no"),
              "enabled must be True or False")]
    for call, message in calls:
        with pytest.raises(TypeError, match=message):
            call()
    assert (tmp_path / "latest").read_text() == "first"
    assert sorted(os.listdir(tmp_path)) == ["first", "latest", "zero_to_fp32.py"]
    engine.close()


def test_a_model_in_ddp_is_refused():
    """accelerate's prepare() wraps a model in DDP: zero trained it with
    both, the wrapper all-reducing every gradient on top of zero's own."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(model())
        with pytest.raises(ValueError, match="model is wrapped in DistributedDataParallel: zero "
                                             r"does the data parallelism itself; pass .*module"):
            zero.initialize(wrapped)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torch_func_transforms_over_the_model(stage):
    """Per-sample gradients with torch.func (vmap of grad over
    functional_call), then a training step: stages 0-2 as torch (stage 2's
    end of backward ran its buckets inside the transform, which failed);
    stage 3 refuses by name (interop hunt)."""
    from torch.func import functional_call, grad, vmap
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=stage)
    x, y = torch.randn(4, 8), torch.randn(4, 4)

    def per_sample(module, params):
        def loss(p, xi, yi):
            return (functional_call(module, p, (xi[None],)) - yi[None]).square().mean()
        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    expected = per_sample(ref, {k: v.detach() for k, v in ref.named_parameters()})
    if stage == 3:
        with pytest.raises(RuntimeError, match="stage 3: the model runs inside a torch.func "
                                               "transform"):
            per_sample(engine.module, {k: v.detach().clone()
                                       for k, v in ref.named_parameters()})
    else:
        got = per_sample(engine.module, {k: v.detach() for k, v in model.named_parameters()})
        for key, value in expected.items():
            assert torch.allclose(got[key], value, atol=1e-6), key
    for m, step in ((engine, engine.step), (ref, ref_opt.step)):
        loss = (m(x) - y).square().mean()
        (engine.backward if m is engine else torch.Tensor.backward)(loss)
        step()
    state = engine.full_state_dict()
    for name, p in ref.named_parameters():
        assert torch.allclose(state[name], p.detach(), atol=1e-6), name
    engine.close()


def test_torch_export_of_released_parameters_is_refused_by_name():
    """torch.export traces with fake tensors, which stage 3's gather read
    the data pointers of: torch's error spoke of custom kernels (interop
    hunt). Refused by name; training goes on, and the closed engine's model
    exports."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0)
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="torch.export of a zero stage-3 model whose "
                                           "parameters are released"):
        torch.export.export(engine.module, (x,))
    engine.backward(engine(x).square().mean())
    engine.step()
    expected = engine.module(x).detach()
    engine.close()
    exported = torch.export.export(model, (x,))
    assert torch.allclose(exported.module()(x), expected, atol=1e-6)


@pytest.mark.parametrize("precision,dtype,advised", [("bf16", torch.float16, "fp16"),
                                                     ("fp32", torch.bfloat16, "bf16")])
def test_16_bit_parameters_of_another_dtype_warn_with_advice_that_applies(precision, dtype,
                                                                           advised):
    """At precision="bf16" the warning about fp16 parameters advised
    precision="bf16", the setting already given (advice hunt)."""
    import warnings
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[1].to(dtype)
    with pytest.warns(RuntimeWarning, match=f'to compute in their dtype pass precision="{advised}"'):
        zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                        precision=precision).close()
    with warnings.catch_warnings():  # the advice followed: no warning
        warnings.simplefilter("error")
        engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                 precision=advised)
    assert m[0].weight.dtype == m[1].weight.dtype == dtype
    engine.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("call", ["to_meta", "half", "to_empty"])
def test_moving_or_casting_the_engine_is_refused_before_anything_changes(stage, call):
    """engine.to("meta") lost every value and ended in torch's device error
    at the next forward; a cast was refused only at the next step."""
    def engine_and_twin():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        return m, zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                  stage=stage, stage3_param_persistence_threshold=0)
    (m, engine), (_, twin) = engine_and_twin(), engine_and_twin()
    attempt = {"to_meta": lambda: engine.to("meta"), "half": engine.half,
               "to_empty": lambda: engine.to_empty(device="meta")}[call]
    with pytest.raises(RuntimeError, match="would move or cast the engine's parameters"):
        attempt()
    assert engine.to("cpu") is engine and engine.float() is engine  # nothing to change
    x = torch.randn(3, 4)
    for e in (engine, twin):
        e.backward(e(x).square().mean())
        e.step()
    ours, theirs = engine.full_state_dict(), twin.full_state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    engine.close()
    twin.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("when", ["before", "after", "never"])
def test_a_scripts_post_accumulate_hook_is_named_once_at_stages_2_3(stage, when):
    """[Note: the script's post-accumulate hooks]: at stages 2-3 such a hook
    sees .grad None (registered after initialize) or one backward's part
    (before); the engine names it once, at initialize or the first step.
    Stages 0-1 keep .grad as torch does, and say nothing."""
    import warnings
    m = model()
    seen = []

    def hook(p):
        seen.append(p.grad is None)
    if when == "before":
        m[0].weight.register_post_accumulate_grad_hook(hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zero.initialize(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                 stage=stage, stage3_param_persistence_threshold=0)
        if when == "after":
            m[0].weight.register_post_accumulate_grad_hook(hook)
        for seed in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
            engine.backward(engine(x).square().mean())
            engine.step()
    named = [w for w in caught if "post-accumulate-grad hook of the script's" in str(w.message)]
    expected = 1 if stage >= 2 and when != "never" else 0
    assert len(named) == expected, [str(w.message) for w in caught]
    if expected:
        assert "parameter '0.weight'" in str(named[0].message)
        assert named[0].filename == __file__  # the script's line, not zero's
    assert seen == ([stage >= 2 and when == "after"] * 3 if when != "never" else [])
    engine.close()

"""DeepSpeed configs read as DeepSpeed reads them: the learning-rate
schedules give DeepSpeed's learning rate at every update, the optimizer
block DeepSpeed's defaults, and HuggingFace's "auto" values are taken or
refused by name.

The expected learning rates were printed by deepspeed 0.19.8's own
WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest (stepped once after
each update, as its engine does), on this machine; they are facts about DeepSpeed, typed in here so the
test needs no DeepSpeed."""
import json

import pytest
import torch
from torch import nn

import zero
from engine_cases import no_launcher
from zero.config._schedulers import scheduler_from_config

DEEPSPEED_LRS = {
    "decay_linear": (
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_min_lr": 1e-4,
                                             "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
                                             "warmup_type": "linear"}},
        [1e-4, 1e-4, 3.25e-4, 5.5e-4, 7.75e-4, 1e-3, 8.5e-4, 7e-4, 5.5e-4, 4e-4, 2.5e-4,
         1e-4, 1e-4]),
    "warmup_log": (
        {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
                                        "warmup_num_steps": 5}},
        [0.0, 0.0, 0.0001292029674220179, 0.00020478185834579558, 0.0002584059348440358,
         3e-4, 3e-4, 3e-4]),
    # DeepSpeed raises a warm-up of 1 step to 2
    "warmup_one": (
        {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                        "warmup_num_steps": 1, "warmup_type": "linear"}},
        [0.0, 0.0, 5e-4, 1e-3, 1e-3]),
}


def test_warmup_cosine_gives_deepspeeds_learning_rates():
    """WarmupCosineLR scales each group's own lr (0.5 and 0.2 here); the
    rates at updates 0, 1, 2, 11, 25 and 49 were printed by deepspeed
    0.19.8's WarmupCosineLR (the whole 50-update run of 4 configs agreed
    within 6e-17). Before, the type was refused."""
    spec = {"type": "WarmupCosineLR", "params": {"total_num_steps": 40,
                                                 "warmup_num_steps": 10}}
    expected = {0: [0.0, 0.0], 1: [0.0, 0.0],
                2: [0.15051499783199057, 0.06020599913279623],
                11: [0.4986306107946841, 0.19945224431787367],
                25: [0.250025, 0.10001], 49: [5e-05, 2e-05]}
    p, q = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 0.5}, {"params": [q], "lr": 0.2}])
    scheduler = scheduler_from_config(spec, opt)
    for update in range(50):
        if update in expected:
            got = [g["lr"] for g in opt.param_groups]
            assert got == pytest.approx(expected[update], rel=1e-12, abs=1e-15), update
        opt.step()
        scheduler.step()
    with pytest.raises(ValueError, match="total_num_steps is required by WarmupCosineLR"):
        scheduler_from_config({"type": "WarmupCosineLR", "params": {}}, opt)
    with pytest.raises(ValueError, match="unknown scheduler.params key"):
        scheduler_from_config({"type": "WarmupCosineLR",
                               "params": {"total_num_steps": 5, "warmup_max_lr": 1}}, opt)


# OneCycle and LRRangeTest on AdamW([{lr 0.5}, {lr 0.2, betas (0.5, 0.6)}]): each
# update's lr per group and beta1 (both groups), printed by deepspeed 0.19.8
CYCLIC = {
    "one_cycle_decay": (
        {"type": "OneCycle", "params": {
            "cycle_min_lr": [1e-4, 2e-4], "cycle_max_lr": 1e-3, "cycle_first_step_size": 3,
            "cycle_second_step_size": 5, "decay_step_size": 2, "decay_lr_rate": 0.5,
            "decay_mom_rate": 0.01, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}},
        [[1e-4, 2e-4], [3.9999999999999996e-4, 4.6666666666666666e-4],
         [7e-4, 7.333333333333333e-4], [1e-3, 1e-3], [8.200000000000001e-4, 8.4e-4],
         [6.4e-4, 6.8e-4], [4.6e-4, 5.200000000000001e-4], [2.8000000000000003e-4, 3.6e-4],
         [1e-4, 2e-4], [8e-5, 1.6e-4], [6.666666666666667e-5, 1.3333333333333334e-4],
         [5.714285714285715e-5, 1.142857142857143e-4], [5e-5, 1e-4],
         [4.4444444444444447e-5, 8.888888888888889e-5], [4e-5, 8e-5],
         [3.6363636363636364e-5, 7.272727272727273e-5]],
        [0.85, 0.9166666666666666, 0.8833333333333333, 0.85, 0.87, 0.89, 0.9099999999999999,
         0.9299999999999999, 0.95, 0.9547499999999999, 0.9594999999999999,
         0.9642499999999998, 0.969, 0.9737499999999999, 0.9784999999999999,
         0.9832499999999998]),
    "one_cycle_stairs": (
        {"type": "OneCycle", "params": {
            "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 6,
            "cycle_second_step_size": 4, "cycle_first_stair_count": 3,
            "cycle_second_stair_count": 2}},
        [[lr, lr] for lr in (0.01, 0.01, 0.04, 0.04, 0.07, 0.07, 0.1, 0.05500000000000001,
                             0.05500000000000001, 0.01, 0.01, 0.01, 0.01, 0.01)],
        [0.8, 0.9, 0.8666666666666667, 0.8666666666666667, 0.8333333333333334,
         0.8333333333333334, 0.8, 0.8500000000000001, 0.8500000000000001, 0.9, 0.9, 0.9, 0.9,
         0.9]),
    "range_test_stairs": (
        {"type": "LRRangeTest", "params": {
            "lr_range_test_min_lr": [1e-3, 1e-2], "lr_range_test_step_size": 3,
            "lr_range_test_step_rate": 0.5, "lr_range_test_staircase": True}},
        [[1e-3, 1e-2]] * 3 + [[1.5e-3, 1.5e-2]] * 3 + [[2e-3, 2e-2]] * 2,
        None),  # the betas stay the optimizer's
}


def two_group_adamw():
    p, q = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    return torch.optim.AdamW([{"params": [p], "lr": 0.5},
                              {"params": [q], "lr": 0.2, "betas": (0.5, 0.6)}])


@pytest.mark.parametrize("case", list(CYCLIC))
def test_cyclic_schedules_give_deepspeeds_numbers(case):
    """DeepSpeed's OneCycle moves beta1 against the lr and sets beta2 to
    0.99; the first update uses min_mom. Before, both types were refused."""
    spec, lrs, beta1s = CYCLIC[case]
    opt = two_group_adamw()
    scheduler = scheduler_from_config(spec, opt)
    for update, want in enumerate(lrs):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(want, rel=1e-12), update
        betas = [g["betas"] for g in opt.param_groups]
        expected = [(0.9, 0.999), (0.5, 0.6)] if beta1s is None else \
            [(beta1s[update], 0.99)] * 2
        assert betas == [pytest.approx(b, rel=1e-12) for b in expected], update
        opt.step()
        scheduler.step()


def test_one_cycle_on_sgd_cycles_the_lr_only():
    """An optimizer without betas: DeepSpeed turns cycle_momentum off (the
    momentum stays); its lrs."""
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    with pytest.warns(UserWarning, match="cycle_momentum is off because SGD has no betas"):
        scheduler = scheduler_from_config({"type": "OneCycle", "params": {
            "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2}}, opt)
    got = []
    for _ in range(7):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert got == pytest.approx([0.01, 0.055, 0.1, 0.055, 0.01, 0.01, 0.01], rel=1e-12)
    assert opt.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize("params, message", [
    ({"cycle_max_lr": 0.1}, "cycle_min_lr is required by OneCycle"),
    ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_step_size": 0},
     "cycle_first_step_size must be > 0"),
    ({"cycle_min_lr": [0.1, 0.2, 0.3], "cycle_max_lr": 0.2},
     "cycle_min_lr has 3 values but the optimizer has 2 param groups"),
    ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_momentum": 1},
     "cycle_momentum must be true or false"),
    ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_stair_count": 1.5},
     "cycle_first_stair_count must be an integer >= 0"),
    ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "warmup_num_steps": 3},
     "unknown scheduler.params key.s. for OneCycle: warmup_num_steps"),
])
def test_one_cycle_values_are_checked(params, message):
    with pytest.raises(ValueError, match=message):
        scheduler_from_config({"type": "OneCycle", "params": params}, two_group_adamw())
    with pytest.raises(ValueError, match="lr_range_test_step_size must be an integer >= 1"):
        scheduler_from_config({"type": "LRRangeTest",
                               "params": {"lr_range_test_step_size": 0}}, two_group_adamw())


def test_engine_trains_with_one_cycles_betas():
    """The engine's step reads the betas OneCycle sets: a stage 2 run from
    a DeepSpeed config matches torch's AdamW driven by the same schedule
    (fp32: a few ulps of the 1e-2 updates over 6 updates)."""
    spec = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                           "cycle_first_step_size": 2,
                                           "cycle_min_mom": 0.5, "cycle_max_mom": 0.9}}
    reference = model()
    opt = torch.optim.AdamW(reference.parameters(), lr=0.0, weight_decay=0.0)
    scheduler = scheduler_from_config(spec, opt)
    engine = zero.initialize(model(), config={
        "zero_optimization": {"stage": 2}, "scheduler": spec, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.0}}})
    torch.manual_seed(1)
    beta1s = set()
    for _ in range(6):
        beta1s.add(opt.param_groups[0]["betas"][0])
        x = torch.randn(5, 4)
        engine.backward(engine(x).square().sum())
        engine.step()
        reference(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        assert engine.optimizer.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    for mine, theirs in zip(engine.module.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
    assert sorted(beta1s) == pytest.approx([0.5, 0.7, 0.9])  # min_mom first, then the cycle
    engine.close()


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("case", list(DEEPSPEED_LRS))
def test_schedule_gives_deepspeeds_learning_rates(case):
    spec, expected = DEEPSPEED_LRS[case]
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))], lr=0.5)
    opt.param_groups.append({**opt.param_groups[0], "params": [nn.Parameter(torch.zeros(1))],
                             "lr": 0.7})  # every group gets the schedule's rate
    scheduler = scheduler_from_config(spec, opt)
    got = [opt.param_groups[0]["lr"]]
    for _ in range(len(expected) - 1):
        opt.step()
        scheduler.step()
        got.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[1]["lr"] == got[-1]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_engine_steps_the_config_schedule_once_per_update():
    spec, expected = DEEPSPEED_LRS["decay_linear"]
    m = model()
    engine = zero.initialize(m, config={"gradient_accumulation_steps": 2, "scheduler": spec,
                                        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    seen = [engine.optimizer.param_groups[0]["lr"]]
    for _ in range(8):
        engine.backward(engine(torch.randn(3, 4)).sum())
        engine.step()
        if engine.micro_steps % 2 == 0:
            seen.append(engine.optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx(expected[:5], rel=1e-12, abs=1e-18)
    state = engine.lr_scheduler.state_dict()  # plain numbers: saved with checkpoints
    assert state["last_epoch"] == 4 and state["warmup_steps"] == 4
    engine.close()


def test_resumed_schedule_continues_at_the_iteration_given():
    spec, expected = DEEPSPEED_LRS["decay_linear"]
    spec = {"type": spec["type"], "params": {**spec["params"], "last_batch_iteration": 5}}
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler = scheduler_from_config(spec, opt)
    got = [opt.param_groups[0]["lr"]]  # iteration 5's rate, then 6, 7, ...
    for _ in range(3):
        opt.step()
        scheduler.step()
        got.append(opt.param_groups[0]["lr"])
    assert got == pytest.approx(expected[6:10], rel=1e-12)


@pytest.mark.parametrize("kind, old, new", [
    ("WarmupDecayLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 2, "total_num_steps": 10},
     {"warmup_max_lr": 0.01, "warmup_num_steps": 2, "total_num_steps": 100}),
    ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 10},
     {"warmup_max_lr": 0.001, "warmup_num_steps": 10}),
    ("WarmupCosineLR", {"warmup_num_steps": 2, "total_num_steps": 10},
     {"warmup_num_steps": 2, "total_num_steps": 100}),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4},
     {"cycle_min_lr": 0.001, "cycle_max_lr": 0.02, "cycle_first_step_size": 8}),
])
def test_a_resumed_config_schedule_follows_the_new_config(tmp_path, kind, old, new):
    """[Note: a schedule resumes where it stopped, on its new curve]: a job
    that changes its schedule's parameters and resumes gets the new curve
    from the saved step, as under DeepSpeed (whose schedules save only
    last_batch_iteration); the saved curve came back whole before."""
    def engine(params):
        torch.manual_seed(0)
        return zero.initialize(model(), stage=2, config={
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "scheduler": {"type": kind, "params": params}})

    def train(e, steps):
        for _ in range(steps):
            e.backward(e(torch.randn(2, 4)).sum())
            e.step()
    saved = engine(old)
    train(saved, 4)
    saved.save_checkpoint(str(tmp_path), tag="t")
    saved.close()
    resumed = engine(new)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    train(resumed, 3)
    through = engine(new)  # the new schedule from the start, 7 updates
    train(through, 7)
    assert resumed.lr_scheduler.last_epoch == through.lr_scheduler.last_epoch == 7
    assert resumed.get_lr() == pytest.approx(through.get_lr(), rel=1e-12)
    resumed.close()
    through.close()


@pytest.mark.parametrize("params, message", [
    ({"warmup_num_steps": 0}, "warmup_num_steps must be an integer >= 1"),
    ({"warmup_max_lr": "auto"}, "warmup_max_lr is 'auto'"),
    ({"warmup_type": "cosine"}, "warmup_type must be 'log' or 'linear'"),
    ({"warmup_min_lr": "0.1"}, "warmup_min_lr must be a finite number"),
])
def test_schedule_values_are_checked(params, message):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    with pytest.raises(ValueError, match=message):
        scheduler_from_config({"type": "WarmupLR", "params": params}, opt)
    with pytest.raises(ValueError, match="total_num_steps is required"):
        scheduler_from_config({"type": "WarmupDecayLR", "params": {}}, opt)


@pytest.mark.parametrize("block, weight_decay", [
    ({"type": "AdamW", "params": {"lr": 1e-2}}, 0.0),     # DeepSpeed's FusedAdam default
    ({"type": "Adam", "params": {"lr": 1e-2}}, 0.0),
    ({"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, 0.01),  # torch's AdamW
    ({"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, 0.1),
])
def test_optimizer_block_takes_deepspeeds_defaults(block, weight_decay):
    engine = zero.initialize(model(), config={"optimizer": block})
    assert engine.optimizer.param_groups[0]["weight_decay"] == weight_decay
    engine.close()


def test_no_optimizer_at_all_is_torchs_adamw():
    engine = zero.initialize(model())
    group = engine.optimizer.param_groups[0]
    assert isinstance(engine.optimizer, torch.optim.AdamW)
    assert (group["lr"], group["weight_decay"]) == (1e-3, 0.01)
    engine.close()


def test_stage_defaults_to_deepspeeds():
    assert zero.Config.from_deepspeed({}).stage == 0
    assert zero.Config.from_deepspeed({"zero_optimization": {"overlap_comm": True}}).stage == 0
    assert zero.Config().stage == 2  # zero.initialize(model) without a config


def test_huggingface_auto_values():
    template = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                "zero_optimization": {"stage": 3, "overlap_comm": True,
                                      "reduce_bucket_size": "auto",
                                      "stage3_prefetch_bucket_size": "auto",
                                      "stage3_param_persistence_threshold": "auto"}}
    cfg = zero.Config.from_deepspeed(template)
    assert cfg.stage == 3 and cfg.reduce_bucket_size == zero.Config().reduce_bucket_size
    assert cfg.train_batch_size is None
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        with pytest.raises(ValueError, match=f"{key} is 'auto', which HuggingFace's DeepSpeed "
                                             "integration fills in"):
            zero.Config.from_deepspeed({**template, key: "auto"})
    # "auto" where no one fills it in: taken for a key without effect here,
    # refused (without blaming HuggingFace) where the value is read
    ignored = {"sub_group_size": "auto", "allgather_bucket_size": "auto"}
    zero.Config.from_deepspeed({**template, "steps_per_print": "auto", "zero_optimization": {
        **template["zero_optimization"], **ignored}})
    with pytest.raises(ValueError, match="zero_optimization.stage3_model_persistence_threshold "
                                         "is 'auto', which neither DeepSpeed nor HuggingFace"):
        zero.Config.from_deepspeed({"zero_optimization": {
            "stage": 3, "stage3_model_persistence_threshold": "auto"}})
    with pytest.raises(ValueError, match="optimizer.params.lr is 'auto'"):
        zero.initialize(model(), config={"optimizer": {"type": "AdamW",
                                                       "params": {"lr": "auto"}}})


def test_reuse_distance_is_read():
    """stage3_max_reuse_distance: DeepSpeed's float spelling read as an
    integer, "auto" our default (0: released right after use), a bad value
    named ([Note: reuse distance] in sharding/_pass_order.py)."""
    def read(value):
        return zero.Config.from_deepspeed(
            {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": value}})
    assert read(1e9).stage3_max_reuse_distance == 10**9
    assert read("auto").stage3_max_reuse_distance == 0 == zero.Config().stage3_max_reuse_distance
    with pytest.raises(ValueError, match="zero_optimization.stage3_max_reuse_distance must be "
                                         "an integer"):
        read(2.5)
    with pytest.raises(ValueError, match=r"stage3_max_reuse_distance must be an integer >= 0 "
                                         r"\(elements\), got -1"):
        read(-1)


def test_deepspeeds_field_names_of_the_stage3_knobs_are_read():
    """DeepSpeed 0.19.8 takes max_live_parameters as well as
    stage3_max_live_parameters (and so on: its config model populates by
    field name or alias); axolotl's zero3_bf16_cpuoffload_*.json write the
    short names, which were refused as "not a DeepSpeed key"."""
    short = {"stage": 3, "max_live_parameters": 123456, "max_reuse_distance": 7,
             "prefetch_bucket_size": 1000, "param_persistence_threshold": 10,
             "model_persistence_threshold": 99, "gather_16bit_weights_on_model_save": True}
    config = zero.Config.from_deepspeed({"zero_optimization": short})
    documented = zero.Config.from_deepspeed({"zero_optimization": {
        ("stage3_" + k if k != "stage" else k): v for k, v in short.items()}})
    assert config == documented
    assert (config.stage3_max_live_parameters, config.stage3_max_reuse_distance,
            config.stage3_prefetch_bucket_size, config.stage3_param_persistence_threshold,
            config.stage3_model_persistence_threshold) == (123456, 7, 1000, 10, 99)
    assert zero.Config.from_deepspeed({"zero_optimization": {
        "stage": 3, "max_live_parameters": 5, "stage3_max_live_parameters": 5}}
    ).stage3_max_live_parameters == 5
    with pytest.raises(ValueError, match="zero_optimization.max_live_parameters and "
                                         "zero_optimization.stage3_max_live_parameters are the "
                                         r"same setting, given two values \(5 and 6\)"):
        zero.Config.from_deepspeed({"zero_optimization": {
            "stage": 3, "max_live_parameters": 5, "stage3_max_live_parameters": 6}})


def test_comms_config_and_monitor_config_are_ignored_as_deepspeed_ignores_them():
    """LLaMA-Factory's shipped configs write "comms_config" and
    "monitor_config" (the names of DeepSpeed's config object's attributes,
    not keys it reads: DeepSpeed 0.19.8 enables nothing from them); they
    were refused as typos. A monitor enabled there is said to log nowhere."""
    import warnings
    block = {"zero_optimization": {"stage": 3}, "comms_config": {"verbose": False},
             "monitor_config": {"enabled": True, "tag": "run", "csv_monitor": {"enabled": False}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = zero.Config.from_deepspeed(block)
    assert config.stage == 3 and config.monitor is None
    block["monitor_config"]["csv_monitor"]["enabled"] = True
    with pytest.warns(UserWarning, match="monitor_config.csv_monitor is enabled, but "
                                         "\"monitor_config\" is not a key DeepSpeed reads"):
        assert zero.Config.from_deepspeed(block).monitor is None


def test_huggingface_zero3_template_is_read():
    """The zero_optimization block of HuggingFace's zero3 template, offload
    blocks included: on a CPU model both "cpu" devices change nothing."""
    block = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
             "offload_param": {"device": "cpu", "pin_memory": True},
             "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
             "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
             "stage3_param_persistence_threshold": "auto",
             "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
             "stage3_gather_16bit_weights_on_model_save": True}
    cfg = zero.Config.from_deepspeed({"zero_optimization": block})
    assert (cfg.stage, cfg.offload_param.device, cfg.offload_optimizer.device) == \
        (3, "cpu", "cpu")
    engine = zero.initialize(model(), config={"zero_optimization": block})
    assert all(fg.param_files is None and fg.offload is None for fg in engine.all_groups)
    engine.close()


def test_config_sources_are_checked(tmp_path):
    with pytest.raises(TypeError, match="config must be a dict, a path"):
        zero.Config.from_deepspeed(2)  # open() would read file descriptor 2
    bad = tmp_path / "bad.json"
    bad.write_text("{'stage': 2}")
    with pytest.raises(ValueError, match="bad.json' is not valid JSON"):
        zero.Config.from_deepspeed(str(bad))
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="holds a JSON list"):
        zero.Config.from_deepspeed(bad)
    with pytest.raises(ValueError, match="reduce_bucket_size must be a finite number"):
        zero.Config.from_deepspeed({"zero_optimization": {"reduce_bucket_size": "5e7"}})
    for key, value in (("gradient_accumulation_steps", True),
                       ("train_micro_batch_size_per_gpu", -4), ("train_batch_size", "8")):
        with pytest.raises(ValueError, match=f"{key} must be"):
            zero.Config.from_deepspeed({key: value})


@pytest.mark.parametrize("given, world, settled", [
    # (train_batch_size, micro, accumulation) as written; None: not in the config
    ((32, 4, None), 1, (4, 8)),     # accumulation derived, as DeepSpeed does
    ((32, 4, None), 2, (4, 4)),
    ((32, None, 2), 2, (8, 2)),     # micro batch derived
    ((32, None, None), 2, (16, 1)),  # the total alone: no accumulation
    ((32, 4, 4), 2, (4, 4)),        # all three, agreeing
])
def test_batch_sizes_settled_as_deepspeed_does(given, world, settled):
    from zero.engine._initialize import settle_batch_sizes
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    cfg = zero.Config.from_deepspeed({k: v for k, v in zip(keys, given) if v is not None})
    cfg = settle_batch_sizes(cfg, world)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == settled


@pytest.mark.parametrize("given, tail", [
    ((32, 4, 3), "x world size 2$"),
    ((30, 4, None), r"x world size 2 \(the accumulation not given, and no whole number fits\)"),
    ((6, None, 4), r"x world size 2 \(the micro batch not given, and no whole number fits\)")])
def test_batch_sizes_that_cannot_agree_are_refused(given, tail):
    """The message says what was derived only when something was."""
    from zero.engine._initialize import settle_batch_sizes
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    cfg = zero.Config.from_deepspeed({k: v for k, v in zip(keys, given) if v is not None})
    with pytest.raises(ValueError, match=f"train_batch_size {given[0]} != micro batch .*{tail}"):
        settle_batch_sizes(cfg, 2)


def test_engine_accumulates_what_the_batch_sizes_imply():
    engine = zero.initialize(model(), config={"train_batch_size": 8,
                                              "train_micro_batch_size_per_gpu": 2})
    assert engine.gradient_accumulation_steps() == 4 and engine.train_batch_size() == 8
    engine.close()
    with pytest.raises(ValueError, match=r"derive it\) but train_batch_size"):
        zero.Config(gradient_accumulation_steps=None)


def test_the_loss_scale_doubles_when_deepspeed_doubles_it():
    """deepspeed 0.19.8's DynamicLossScaler.update_scale, driven with these
    overflow patterns, printed these scales (window 3, hysteresis 2,
    start 2**4): the first doubling comes at the 4th good step, not the
    3rd, and after an overflow the count starts again."""
    from zero.step._loss_scaler import DynamicLossScaler
    cfg = zero.Config.from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 4,
                                               "loss_scale_window": 3, "hysteresis": 2}})
    cases = [([False] * 7, [16, 16, 16, 32, 32, 32, 64]),
             ([False, False, True, False, False, False, False, True, True, False],
              [16, 16, 16, 16, 16, 16, 32, 32, 16, 16])]
    for pattern, want in cases:
        scaler = DynamicLossScaler(cfg.loss_scaling)
        seen = []
        for overflow in pattern:
            scaler.update(overflow)
            seen.append(scaler.scale)
        assert seen == want, pattern


def test_a_static_scale_stays_the_configured_one_after_a_load():
    """A checkpoint of a dynamic run (scale 256) loaded by a static engine
    (1024) froze the scale at 256: neither the config nor the run."""
    from zero.step._loss_scaler import DynamicLossScaler
    dynamic = DynamicLossScaler(zero.LossScaling(initial_scale_power=8))
    static = DynamicLossScaler(zero.LossScaling(static_loss_scale=1024))
    static.load_state_dict(dynamic.state_dict())
    assert static.scale == 1024.0
    dynamic.load_state_dict({"scale": 32.0, "hysteresis_left": 1, "good_steps": 5})
    assert (dynamic.scale, dynamic.hysteresis_left, dynamic.good_steps) == (32.0, 1, 5)


def test_an_overflow_at_the_minimum_scale_stops_the_run():
    """At min_loss_scale with the hysteresis spent, every later step was
    skipped without a word (50 NaN steps, 0 updates); DeepSpeed raises.
    A static scale never gets there: its overflows are skipped."""
    m = model()
    engine = zero.initialize(m, config={"fp16": {"enabled": True, "initial_scale_power": 1,
                                                 "hysteresis": 1, "min_loss_scale": 1},
                                        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(engine(torch.full((2, 4), float("nan"))).sum())
    engine.step()  # skipped; the scale halves to its floor
    assert (engine.loss_scale, engine.skipped_steps) == (1.0, 1)
    engine.backward(engine(torch.full((2, 4), float("nan"))).sum())
    with pytest.raises(FloatingPointError, match="overflowed .* again with the loss scale at "
                                                 "its floor, loss_scaling.min_loss_scale = 1"):
        engine.step()
    # the step is whole: counted as skipped, its gradients dropped, so a
    # script that catches the error trains on (the NaN gradients stayed,
    # and every later step raised the same error)
    assert (engine.skipped_steps, engine.global_steps) == (2, 0)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    engine.close()


@pytest.mark.parametrize("consecutive, scales", [
    # hysteresis 2; overflow, good, overflow, overflow
    (False, [2.0 ** 8, 2.0 ** 8, 2.0 ** 7, 2.0 ** 6]),  # the good step does not restore it
    (True, [2.0 ** 8, 2.0 ** 8, 2.0 ** 8, 2.0 ** 7]),   # only 2 overflows in a row halve
])
def test_consecutive_hysteresis(consecutive, scales):
    from zero.step._loss_scaler import DynamicLossScaler
    cfg = zero.Config.from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 8,
                                               "hysteresis": 2,
                                               "consecutive_hysteresis": consecutive}})
    scaler = DynamicLossScaler(cfg.loss_scaling)
    seen = []
    for overflow in (True, False, True, True):
        scaler.update(overflow)
        seen.append(scaler.scale)
    assert seen == scales


def test_an_overflow_at_the_floor_restarts_the_good_steps():
    """The floor's error left the count of good steps as it was: a script
    that caught it and trained on had its scale doubled early."""
    from zero.step._loss_scaler import DynamicLossScaler
    cfg = zero.Config.from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 0,
                                               "hysteresis": 1, "min_loss_scale": 1,
                                               "loss_scale_window": 2}})
    scaler = DynamicLossScaler(cfg.loss_scaling)
    scaler.update(False)
    scaler.update(False)
    with pytest.raises(FloatingPointError):
        scaler.update(True)
    assert scaler.good_steps == 0
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 1.0  # doubles at the third good step after, not the first


# ---- DeepSpeed 0.19.8's defaults and parsing (found by a review against
# deepspeed 0.19.8's DeepSpeedConfig, lr_schedules and ops, on this machine)


def test_warmup_lr_without_a_max_warms_each_group_to_its_own_lr():
    """DeepSpeed's WarmupLR takes each group's lr when warmup_max_lr is
    left out (its rates, printed by deepspeed 0.19.8 for these groups);
    zero warmed every group up to 0.001. WarmupDecayLR's default stays
    0.001, as DeepSpeed's."""
    expected = [[0.0, 0.0], [0.0, 0.0], [7.5e-05, 2.5e-06], [1.5e-04, 5e-06],
                [2.25e-04, 7.5e-06], [3e-04, 1e-05], [3e-04, 1e-05]]
    p, q = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [p], "lr": 3e-4}, {"params": [q], "lr": 1e-5}])
    scheduler = scheduler_from_config({"type": "WarmupLR", "params": {
        "warmup_num_steps": 4, "warmup_type": "linear"}}, opt)
    for update, rates in enumerate(expected):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(rates, rel=1e-12,
                                                                    abs=1e-18), update
        opt.step()
        scheduler.step()
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler = scheduler_from_config({"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 2, "total_num_steps": 10, "warmup_type": "linear"}}, opt)
    for _ in range(3):
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)  # the peak: 0.001, not 0.5
    with pytest.raises(ValueError, match="for WarmupLR: total_num_steps .*WarmupDecayLR"):
        scheduler_from_config({"type": "WarmupLR", "params": {"total_num_steps": 10}}, opt)


def test_a_config_without_gradient_clipping_clips_at_one():
    """DeepSpeed 0.19.8 clips at 1.0 when the config names no
    gradient_clipping (zero read 0: no clipping); 0 written out turns it
    off; zero.initialize without a config keeps 0."""
    assert zero.Config.from_deepspeed({}).gradient_clipping == 1.0
    assert zero.Config.from_deepspeed({"gradient_clipping": 0}).gradient_clipping == 0.0
    assert zero.Config().gradient_clipping == 0.0
    for config, moved in (({}, 1.0), ({"gradient_clipping": 0.0}, 200.0)):
        layer = nn.Linear(4, 1, bias=False)
        before = layer.weight.detach().clone()
        engine = zero.initialize(layer, config={
            **config, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
        x = torch.zeros(1, 4)
        x[0, 0] = 200.0  # a gradient of norm 200
        engine.backward(engine(x).sum())
        engine.step()
        assert (layer.weight.detach() - before).norm().item() == pytest.approx(moved, rel=1e-6)
        engine.close()


@pytest.mark.parametrize("stage, skips", [(0, True), (1, True), (2, True), (3, False)])
def test_a_bf16_config_skips_steps_with_nonfinite_gradients(stage, skips):
    """DeepSpeed 0.19.8's bf16.check_grad_overflow defaults to true and
    skips such a step at stages 0-2 (its stage 3 checks fp16 only): zero
    applied it (an inf in the weights)."""
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    assert zero.Config.from_deepspeed(config).check_grad_overflow is skips
    written = {**config, "bf16": {"enabled": True, "check_grad_overflow": not skips}}
    assert zero.Config.from_deepspeed(written).check_grad_overflow is (not skips)
    layer = nn.Linear(4, 1, bias=False)
    engine = zero.initialize(layer, config=config)
    x = torch.full((1, 4), float("inf"))
    engine.backward(engine(x).sum())
    engine.step()
    assert engine.was_step_applied() is (not skips)
    engine.close()


@pytest.mark.parametrize("enabled, precision", [
    ("false", "fp32"), ("False", "fp32"), ("true", "bf16"), ("TRUE", "bf16"), (1, "bf16"),
    (0, "fp32"), (True, "bf16"), (False, "fp32")])
def test_enabled_is_read_as_deepspeed_reads_it(enabled, precision):
    """DeepSpeed's config model reads "false" as false; zero took any
    non-empty string as true, so "false" trained in bf16."""
    assert zero.Config.from_deepspeed({"bf16": {"enabled": enabled}}).precision == precision
    fp16 = "fp16" if precision == "bf16" else "fp32"
    assert zero.Config.from_deepspeed({"fp16": {"enabled": enabled}}).precision == fp16


def test_enabled_that_is_no_boolean_is_refused_by_name():
    with pytest.raises(ValueError, match="fp16.enabled must be true or false, got 'maybe'"):
        zero.Config.from_deepspeed({"fp16": {"enabled": "maybe"}})
    with pytest.raises(ValueError, match="both true"):
        zero.Config.from_deepspeed({"fp16": {"enabled": "true"}, "bf16": {"enabled": "yes"}})


def test_optimizer_blocks_take_deepspeeds_defaults():
    """Lion: DeepSpeed's FusedLion/DeepSpeedCPULion default to lr 1e-3 and
    betas (0.9, 0.999) (zero gave 1e-4 and (0.9, 0.99)). AdamW ignores
    adam_w_mode and Adam-family blocks take bias_correction true, as
    DeepSpeed does (torch raised on the unknown keyword)."""
    from zero.optim._from_config import optimizer_from_config
    params = [nn.Parameter(torch.zeros(2))]
    lion = optimizer_from_config({"type": "Lion"}, params)
    assert (lion.defaults["lr"], tuple(lion.defaults["betas"])) == (1e-3, (0.9, 0.999))
    adamw = optimizer_from_config({"type": "AdamW", "params": {"adam_w_mode": False,
                                                               "bias_correction": True}}, params)
    assert type(adamw) is torch.optim.AdamW
    with pytest.raises(ValueError, match="optimizer.params.bias_correction: only true"):
        optimizer_from_config({"type": "Adam", "params": {"bias_correction": False}}, params)



def test_optimizer_blocks_and_old_switches_are_read_as_deepspeed_reads_them():
    """"false" as a word is false (Python's truth made it true: Adam with
    adam_w_mode "false" ran AdamW, cpu_offload "false" offloaded), a typo
    of the block's keys is named (it left the rest unread: the default lr,
    or AdamW for SGD), and a malformed block says what it must be."""
    from zero.optim._from_config import optimizer_from_config
    params = [nn.Parameter(torch.zeros(2))]
    adam = optimizer_from_config({"type": "Adam", "params": {"adam_w_mode": "false"}}, params)
    assert type(adam) is torch.optim.Adam
    for block, message in (({"type": "SGD", "param": {"lr": 0.5}}, "'param' .a typo of "
                                                                    "'params'"),
                           ({"typ": "SGD"}, "'typ' .a typo of 'type'"),
                           ("AdamW", "optimizer must be a block"),
                           ({"type": 5}, "optimizer.type must be a name"),
                           ({"type": "SGD", "params": [1]}, "optimizer.params must be a block"),
                           ({"type": "AdamW", "params": {"betas": "0.9,0.99"}},
                            "betas must be two numbers"),
                           ({"type": "Adam", "params": {"adam_w_mode": "maybe"}},
                            "adam_w_mode must be true or false")):
        with pytest.raises(ValueError, match=message):
            optimizer_from_config(block, params)
    with pytest.warns(DeprecationWarning):
        cfg = zero.Config.from_deepspeed({"zero_optimization": {
            "stage": 3, "cpu_offload": "false", "cpu_offload_param": "false"}})
    assert cfg.offload_optimizer.device == "none" and cfg.offload_param.device == "none"


@pytest.mark.parametrize("config, match", [
    ({"fp16": True}, r"fp16 must be a block such as \{\"enabled\": true\}, got True"),
    ({"bf16": "yes"}, "bf16 must be a block"),
    ({"data_types": "fp32"}, "data_types must be a block such as"),
    ({"aio": {"block_size": float("inf")}}, "aio.block_size must be an integer from 1 to 2"),
    ({"aio": {"queue_depth": 10**30}}, "aio.queue_depth must be an integer from 1 to 2"),
    ({"aio": {"block_size": 1000}}, "aio.block_size must be a multiple of 4096 bytes"),
    ({"aio": {"block_size": 2**31 - 4096}}, "aio.block_size must be a multiple of 4096 bytes up"),
    ({"aio": {"queue_depth": 5000}}, "aio.queue_depth must be at most 1024, got 5000"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e30}},
     "reduce_bucket_size must be an integer from 1 to 2"),
    ({"scheduler": "WarmupLR"}, "scheduler must be a block such as"),
    ({"scheduler": {"type": "WarmupLR", "params": "x"}}, "scheduler must be a block such as"),
    # a typo inside a block: it trained in fp32, or with the schedule's
    # defaults, silently (a DeepSpeed hunt; DeepSpeed refuses them)
    ({"bf16": {"enable": True}}, r"bf16.enable: not a DeepSpeed key \(a typo of 'bf16.enabled'"),
    ({"fp16": {"enable": True}}, r"fp16.enable: not a DeepSpeed key \(a typo of 'fp16.enabled'"),
    ({"scheduler": {"type": "WarmupLR", "param": {"warmup_num_steps": 10}}},
     r"scheduler.param: not a key of the scheduler block, .*a typo of 'scheduler.params'"),
])
def test_malformed_blocks_are_refused_by_name(config, match):
    """Before: bare AttributeErrors and OverflowErrors from deep inside
    (a bool's .get, int(inf), a size past the C core's)."""
    with pytest.raises(ValueError, match=match):
        zero.initialize(model(), config=config)


def test_a_bucket_size_is_an_integer_not_a_flag():
    for wrong in (True, 2**63):  # True trained with 1-element buckets
        with pytest.raises(ValueError, match="reduce_bucket_size must be an integer"):
            zero.Config(reduce_bucket_size=wrong)


def test_a_zero_block_that_is_no_block_and_a_file_that_is_no_utf8_are_named(tmp_path):
    for wrong in ([], 0, False):  # read as "no block" (stage 0) before
        with pytest.raises(ValueError, match="zero_optimization must be an object"):
            zero.Config.from_deepspeed({"zero_optimization": wrong})
    path = tmp_path / "ds.json"
    path.write_bytes(b'{"train_batch_size": "\xff"}')
    with pytest.raises(ValueError, match=r"ds.json' is not valid JSON \(UTF-8\)"):
        zero.Config.from_deepspeed(str(path))


def test_wall_clock_breakdown_on_says_it_prints_nothing():
    """DeepSpeed prints its timers with it on; zero has none, and said
    nothing (logs hunt). Off, or left out: no word."""
    import warnings
    with pytest.warns(UserWarning, match="wall_clock_breakdown is on, but zero keeps no"):
        zero.Config.from_deepspeed({"train_micro_batch_size_per_gpu": 2,
                                    "wall_clock_breakdown": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero.Config.from_deepspeed({"train_micro_batch_size_per_gpu": 2,
                                    "wall_clock_breakdown": False})

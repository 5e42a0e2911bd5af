"""DeepSpeed's engine queries of its config (engine/_deepspeed_settings.py):
the answers DeepSpeed 0.19.8 gave for the same config on this machine's CPU
(stop 43, recorded below), and set_train_batch_size against a plain torch
run whose accumulation changes at the same update."""
import pytest
import torch
from torch import nn

import zero.deepspeed as deepspeed

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                "reduce_bucket_size": 5e7,
                                "stage3_prefetch_bucket_size": 123,
                                "stage3_max_live_parameters": 456,
                                "stage3_max_reuse_distance": 789,
                                "stage3_param_persistence_threshold": 1000},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}

# DeepSpeed 0.19.8's answers for CONFIG (its engine, one CPU process).
# Left out: zero_overlap_comm (DeepSpeed's default is false at stage 2, ours
# true: each answers its own), and get_model_parallel_rank /
# get_data_parallel_rank, which DeepSpeed fails without an mpu (an
# AssertionError: "group is not initialized"); zero answers 0.
DEEPSPEED_ANSWERS = {
    "steps_per_print": 1000, "zero_cpu_offload": True, "zero_use_cpu_optimizer": True,
    "dynamic_loss_scale": True, "initial_dynamic_scale": 65536,
    "optimizer_params": {"lr": 0.001}, "scheduler_name": "WarmupLR",
    "scheduler_params": {"warmup_num_steps": 10}, "zero_reduce_bucket_size": 50000000,
    "zero_prefetch_bucket_size": 123, "zero_max_live_parameters": 456,
    "zero_max_reuse_distance": 789, "zero_param_persistence_threshold": 1000,
    "zero_contiguous_gradients": True,
}


def engine_of(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return engine


def test_answers_are_deepspeeds(deepspeed_script):
    engine = engine_of(CONFIG)
    for name, expected in DEEPSPEED_ANSWERS.items():
        assert getattr(engine, name)() == expected, name
    assert engine.zero_offload_optimizer().device == "cpu"
    assert engine.zero_offload_param() is None
    assert engine.mp_world_size == 1
    assert engine.get_model_parallel_rank() == engine.get_data_parallel_rank() == 0
    assert engine.communication_data_type == torch.float32
    engine.close()


def test_answers_follow_the_config(deepspeed_script):
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2.0,
              "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
              "zero_optimization": {"stage": 3, "overlap_comm": False,
                                    "contiguous_gradients": False},
              "fp16": {"enabled": False, "loss_scale": 128}}
    engine = engine_of(config)
    assert engine.steps_per_print() == 2  # a JSON writer's 2.0, a whole number
    assert engine.communication_data_type == torch.float32  # the fp32 accumulation
    assert engine.zero_overlap_comm() is False and engine.zero_contiguous_gradients() is False
    assert engine.zero_offload_optimizer() is None and engine.zero_cpu_offload() is False
    assert engine.optimizer_params() is None and engine.scheduler_name() is None
    assert engine.dynamic_loss_scale() is True  # fp16 off: its block is not read
    engine.close()
    engine = engine_of({"train_micro_batch_size_per_gpu": 2, "steps_per_print": "auto",
                        "bf16": {"enabled": True}})
    assert engine.steps_per_print() is None  # accepted as before, read as unset
    assert engine.communication_data_type == torch.bfloat16
    engine.close()


def test_set_train_batch_size_changes_the_accumulation(deepspeed_script):
    """Three updates of 2 micro-batches, then set_train_batch_size(8) (4
    of 2 samples), two updates of 4 (6 micro-steps counted at the change,
    not a multiple of 4: the next update still waits for 4 more): the parameters of a plain AdamW that
    averages the same micro-batches' gradients the same way."""
    engine = engine_of({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                        "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                        "zero_optimization": {"stage": 2}})
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    # weight_decay 0: DeepSpeed's AdamW block default, which the engine takes
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    data = torch.Generator().manual_seed(1)
    micro = [(torch.randn(2, 8, generator=data), torch.randn(2, 2, generator=data))
             for _ in range(14)]

    def update(batches, engine_first):
        for x, y in batches:
            engine.backward(nn.functional.mse_loss(engine(x), y))
            assert engine.was_step_applied() is False or engine_first
            engine.step()
            engine_first = False
        assert engine.was_step_applied()
        optimizer.zero_grad()
        for x, y in batches:
            (nn.functional.mse_loss(reference(x), y) / len(batches)).backward()
        optimizer.step()

    update(micro[0:2], True)
    update(micro[2:4], True)
    update(micro[4:6], True)
    engine.set_train_batch_size(8)
    assert engine.gradient_accumulation_steps() == 4 and engine.train_batch_size() == 8
    update(micro[6:10], True)
    update(micro[10:14], True)
    assert engine.global_steps == 5
    state = engine.full_state_dict()
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(state[name], p, rtol=1e-5, atol=1e-6)

    engine.backward(nn.functional.mse_loss(engine(micro[0][0]), micro[0][1]))
    engine.step()  # one of 4 accumulated
    with pytest.raises(RuntimeError, match="1 micro-batch.*of 4 are accumulated"):
        engine.set_train_batch_size(4)
    for bad in (3, 0, -4, 4.0, True, "8"):
        with pytest.raises(ValueError, match="train_batch_size must be a positive multiple "
                                             "of train_micro_batch_size_per_gpu 2"):
            engine.set_train_batch_size(bad)
    assert engine.gradient_accumulation_steps() == 4  # the refusals changed nothing
    engine.close()


def test_config_steps_per_print_is_checked():
    import zero
    with pytest.raises(ValueError, match="steps_per_print must be a positive integer"):
        zero.Config(steps_per_print=0)
    assert zero.Config(steps_per_print=10).steps_per_print == 10

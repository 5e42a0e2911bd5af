"""What a DeepSpeed-Chat script does with its engines beyond training,
under `import zero.deepspeed as deepspeed` (one process): a stage-3 save
that finds released parameters by DeepSpeed's attributes and gathers them
itself, calls of the model's own methods on the engine, and
init_distributed() before initialize(..., dist_init_required=True)."""

import pytest
import torch
from torch import nn

import zero.deepspeed as deepspeed
from zero.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

CONFIG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

class Critic(nn.Module):
    """A model with methods and attributes of its own, as DS-Chat's critic."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
        self.num_padding_at_beginning = 1

    def forward(self, x):
        return self.head(torch.tanh(self.body(x))).squeeze(-1)

    def forward_value(self, x, scale=1.0):
        return self(x) * scale

def test_a_save_that_gathers_by_deepspeeds_attributes_writes_whole_weights(deepspeed_script,
                                                                              tmp_path):
    torch.manual_seed(0)
    model = Critic()
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    loss = engine(torch.randn(2, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        expected = {k: v.detach().clone() for k, v in model.named_parameters()}
    saved = {}
    for name, p in model.named_parameters():  # the DS-Chat way, in our words
        released = [p] if hasattr(p, "ds_id") and \
            p.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
        with deepspeed.zero.GatheredParameters(released, enabled=bool(released)):
            saved[name] = p.data.cpu()
    torch.save(saved, tmp_path / "pytorch_model.bin")
    loaded = torch.load(tmp_path / "pytorch_model.bin")
    assert set(loaded) == set(expected)
    for name, value in loaded.items():
        assert torch.equal(value, expected[name]), name
    engine.close()

def test_the_engine_answers_for_the_models_own_attributes(deepspeed_script):
    torch.manual_seed(0)
    model = Critic()
    engine, *_ = deepspeed.initialize(model=model, config={**CONFIG, "zero_optimization":
                                                           {"stage": 2}})
    x = torch.randn(2, 8)
    assert torch.equal(engine.forward_value(x, scale=2.0), model.forward_value(x, scale=2.0))
    assert engine.num_padding_at_beginning == 1
    assert engine.module is model and engine.global_steps == 0  # the engine's own first
    with pytest.raises(AttributeError, match="nor has its model \\(Critic\\)"):
        engine.no_such_thing
    model._private = 1
    assert not hasattr(engine, "_private")  # private names stay the engine's
    engine.close()

def test_initialize_after_init_distributed_with_dist_init_required(deepspeed_script):
    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=True)  # already: used
    engine, *_ = deepspeed.initialize(model=Critic(), config=CONFIG, dist_init_required=True)
    assert engine.world_size == 1
    engine.close()

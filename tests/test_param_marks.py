"""What the engine leaves on a user's parameters: its marks stay out of a
parameter's pickle ([Note: marks not pickled] in sharding/_param_marks.py),
and a stage-3 parameter carries DeepSpeed's ds_* attributes while the
engine lives ([Note: DeepSpeed's parameter attributes])."""
import copy
import io

import pytest
import torch
from torch import nn

import zero
from zero.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


def two_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def saved_and_loaded(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only=True, torch's default


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_parameter_pickles_as_a_plain_one(stage):
    """torch.save of parameters themselves (not a state dict) loads with
    torch.load's defaults: the engine's Place needed zero to load, and a
    frozen parameter's weakref (stages 0-2) could not be pickled at all."""
    model = two_layers()
    model[0].weight.requires_grad_(False)  # frozen: kept whole at stages 0-2
    model[1].bias.tag = "mine"             # a user's attribute goes along
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad]), stage=stage)
    with zero.GatheredParameters(list(model.parameters())):
        expected = {k: v.detach().clone() for k, v in model.named_parameters()}
        loaded = saved_and_loaded(dict(model.named_parameters()))
        one = saved_and_loaded(model[1].bias)
        shallow = copy.copy(model[1].weight)
    assert set(loaded) == set(expected)
    for name, value in loaded.items():
        assert type(value) is nn.Parameter and torch.equal(value, expected[name]), name
        assert not any(k.startswith(("_zero_", "ds_")) for k in vars(value)), name
    assert one.tag == "mine" and torch.equal(one, expected["1.bias"])
    assert not hasattr(shallow, "_zero_place") and not hasattr(shallow, "ds_id")
    engine.close()
    assert torch.equal(saved_and_loaded(model[0].weight), expected["0.weight"])


def test_stage_3_parameters_carry_deepspeeds_attributes():
    model = two_layers()
    shapes = {k: v.shape for k, v in model.named_parameters()}
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             stage3_param_persistence_threshold=0)
    params = dict(model.named_parameters())
    assert len({p.ds_id for p in params.values()}) == len(params)
    for name, p in params.items():
        assert p.ds_shape == shapes[name] and p.ds_numel == shapes[name].numel()
        assert p.ds_persist is False and p.numel() == 0
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE, name
    seen = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(m.weight.ds_status))
    engine(torch.randn(2, 8))
    assert seen == [ZeroParamStatus.AVAILABLE]  # gathered while its module runs
    assert model[1].weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    with zero.GatheredParameters([model[0].weight]):
        assert model[0].weight.ds_status == ZeroParamStatus.AVAILABLE
        assert model[0].weight.shape == shapes["0.weight"]
    assert model[0].weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    engine.close()
    assert not any(hasattr(p, name) for p in model.parameters()
                   for name in ("ds_id", "ds_status", "ds_numel", "ds_shape", "ds_persist"))


def test_persistent_units_say_available_and_stage_2_has_no_ds_attributes():
    model = two_layers()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3)
    assert all(p.ds_persist and p.ds_status == ZeroParamStatus.AVAILABLE
               for p in model.parameters())  # under the threshold: gathered for good
    engine.close()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=2)
    assert not any(hasattr(p, "ds_id") for p in model.parameters())  # as DeepSpeed's
    engine.close()


class StatefulParameter(nn.Parameter):
    """A Parameter subclass with state of its own, copied through its own
    __getstate__/__setstate__ (as quantized parameters of some libraries)."""

    def __new__(cls, data, requires_grad=True, scale=1.0):
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self.scale = scale
        return self

    def __getstate__(self):
        return {**self.__dict__, "data": self.data, "requires_grad": self.requires_grad}

    def __setstate__(self, state):
        self.requires_grad = state["requires_grad"]
        self.scale = state["scale"]
        self.data = state["data"]

    def __copy__(self):
        new = type(self).__new__(type(self), self.data, self.requires_grad)
        new.__setstate__(self.__getstate__())
        return new


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_parameter_class_with_its_own_state_copies_as_before_and_after(stage):
    """The marks' __getstate__ defers to the class's and only leaves the
    marks out; close() takes it off with the last mark."""
    model = two_layers()
    model[0].weight = StatefulParameter(model[0].weight.detach().clone(), stage == 0, 2.0)
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad]), stage=stage)
    with zero.GatheredParameters(list(model.parameters())):
        expected = model[0].weight.detach().clone()
        copied = copy.copy(model[0].weight)
        assert type(copied) is StatefulParameter and copied.scale == 2.0
        assert torch.equal(copied, expected)
        assert not any(k.startswith(("_zero_", "ds_")) or k == "__getstate__"
                       for k in vars(copied))
    engine.close()
    assert sorted(vars(model[0].weight)) == ["scale"]  # nothing of the engine's left
    assert copy.copy(model[0].weight).scale == 2.0


def test_ds_status_equals_deepspeeds_own_enum():
    """A script that kept DeepSpeed's import of ZeroParamStatus (DeepSpeed
    installed beside zero) compares with that enum's members."""
    import enum

    class ZeroParamStatus(enum.Enum):  # as deepspeed.runtime.zero.partition_parameters has it
        AVAILABLE = 1
        NOT_AVAILABLE = 2
        INFLIGHT = 3
    model = two_layers()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             stage3_param_persistence_threshold=0)
    status = model[0].weight.ds_status
    assert status == ZeroParamStatus.NOT_AVAILABLE and ZeroParamStatus.NOT_AVAILABLE == status
    assert status != ZeroParamStatus.AVAILABLE and not (status != ZeroParamStatus.NOT_AVAILABLE)
    assert status in {ZeroParamStatus.NOT_AVAILABLE: 0}  # hashed alike
    engine.close()

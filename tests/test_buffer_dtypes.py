"""The dtypes of a model's buffers in a bf16/fp16 engine ([Note: buffer
dtypes] in engine/_construction.py): a floating buffer keeps its dtype, as
DeepSpeed 0.19 and FSDP2 keep it; batch-norm statistics follow the
precision (torch's kernels want them in the weight's dtype); buffer_dtype
(DeepSpeed's data_types.buffer_dtype) casts the rest. Reference: the same
model in plain torch with its parameters cast and its buffers as asked,
which computes bit for bit what the engine's forward does."""
import copy

import pytest
import torch
from torch import nn

import zero

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Rotary(nn.Module):
    """A RoPE-like model: angles of far positions from an fp32 inv_freq,
    which bf16 (8 bits of mantissa) would move by whole radians."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8),
                             persistent=False)

    def forward(self, x):
        positions = torch.arange(4000, 4000 + x.shape[0], dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)
        rotation = torch.cat([angles.cos(), angles.sin()], dim=-1).to(x.dtype)
        return self.lin(x) * rotation


def params_cast(model, dtype):
    """A plain-torch copy of model whose parameters only are in dtype."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.data = p.data.to(dtype)
    return ref


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_float_buffer_keeps_its_dtype(stage, precision):
    torch.manual_seed(0)
    model = Rotary()
    ref = params_cast(model, DTYPES[precision])
    engine = zero.initialize(model, stage=stage, precision=precision,
                             stage3_param_persistence_threshold=0)
    assert model.inv_freq.dtype == torch.float32
    x = torch.randn(6, 8)
    assert torch.equal(engine(x), ref(x.to(DTYPES[precision])))
    # computed in bf16, position 4005's angles are off by more than a radian
    assert not torch.equal(model.inv_freq.bfloat16().float(), model.inv_freq)
    engine.close()
    assert model.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("buffer_dtype", [None, "fp32"])
def test_batch_norm_statistics_follow_the_precision(stage, buffer_dtype):
    """torch's batch norm refuses fp32 running statistics beside bf16
    weights ("expected scalar type BFloat16 but found Float"), where
    DeepSpeed 0.19 fails: the statistics take the compute dtype whatever
    buffer_dtype says, and close() gives them back in fp32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    ref = copy.deepcopy(model).bfloat16()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                             stage=stage, precision="bf16", buffer_dtype=buffer_dtype,
                             stage3_param_persistence_threshold=0)
    assert model[1].running_mean.dtype == torch.bfloat16
    assert model[1].num_batches_tracked.dtype == torch.int64
    for _ in range(2):
        x = torch.randn(6, 8)
        out = engine(x)
        assert torch.equal(out, ref(x.bfloat16()))
        engine.backward(out.float().square().mean())
        engine.step()
    assert torch.equal(model[1].running_var, ref[1].running_var)
    engine.close()
    assert model[1].running_mean.dtype == torch.float32


def test_buffer_dtype_casts_the_other_buffers():
    torch.manual_seed(0)
    model = Rotary()
    model.register_buffer("total", torch.zeros((), dtype=torch.float64))
    ref = params_cast(model, torch.bfloat16)
    ref.inv_freq = ref.inv_freq.bfloat16()
    engine = zero.initialize(model, stage=0, precision="bf16", buffer_dtype="bf16")
    assert model.inv_freq.dtype == model.total.dtype == torch.bfloat16
    x = torch.randn(3, 8)
    assert torch.equal(engine(x), ref(x.bfloat16()))
    engine.close()
    assert model.inv_freq.dtype == torch.float32 and model.total.dtype == torch.float64


@pytest.mark.parametrize("named, ours", [("bfloat16", "bf16"), ("torch.float32", "fp32"),
                                         ("half", "fp16"), ("fp32", "fp32"), (None, None)])
def test_deepspeeds_buffer_dtype_is_read(named, ours):
    config = zero.Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1,
                                         "bf16": {"enabled": True},
                                         "data_types": {"buffer_dtype": named}})
    assert config.buffer_dtype == ours


def test_a_buffer_dtype_zero_cannot_give_is_refused_by_name():
    with pytest.raises(ValueError, match=r"data_types.buffer_dtype must name fp32, bf16 or "
                                         r"fp16 .*got 'int8'"):
        zero.Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1,
                                    "data_types": {"buffer_dtype": "int8"}})
    with pytest.raises(ValueError, match=r"buffer_dtype must be None \(each buffer keeps its "
                                         r"dtype\) or one of .*got 'float32'"):
        zero.initialize(Rotary(), buffer_dtype="float32")


class PositionTable(nn.Module):
    """M2M100's and XGLM's way: an fp32 sinusoid table added to the bf16
    embeddings, then a LayerNorm, which refuses the float32 sum."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.register_buffer("table", torch.randn(6, 8))
        self.norm = nn.LayerNorm(8)

    def forward(self, ids):
        return self.norm(self.embed(ids) + self.table[:ids.shape[-1]])


def test_a_forward_that_mixes_a_kept_buffer_in_says_what_to_set():
    ids = torch.randint(0, 10, (2, 6))
    engine = zero.initialize(PositionTable(), stage=0, precision="bf16")
    with pytest.raises(RuntimeError) as caught:
        engine(ids)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "floating buffers keep their dtype (1: 'table')" in notes
    assert 'buffer_dtype="bf16"' in notes and '"data_types": {"buffer_dtype": "bf16"}' in notes
    engine.close()
    engine = zero.initialize(PositionTable(), stage=0, precision="bf16", buffer_dtype="bf16")
    assert engine(ids).dtype == torch.bfloat16
    engine.close()

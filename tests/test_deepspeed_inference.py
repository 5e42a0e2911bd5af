"""deepspeed.init_inference on zero's engine ([Note: init_inference] in
deepspeed/_inference.py): the model replicated in the dtype asked for,
its train/eval mode kept, as DeepSpeed 0.19.8's InferenceEngine without
kernel injection; the reference is the plain model with its parameters
cast (DeepSpeed's gave the same 0.00168 largest bf16 difference from fp32
on the hunt's model). What needs DeepSpeed's kernels or several ranks
per model is refused by name."""
import copy
import json

import pytest
import torch
from torch import nn

import zero.deepspeed as deepspeed
from engine_cases import no_launcher
from test_inference_engine import tiny_gpt2


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    no_launcher(monkeypatch)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "bf16", "torch.bfloat16"])
def test_the_model_runs_in_the_dtype_asked_for(dtype):
    model = net()
    wanted = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
    reference = copy.deepcopy(model).to(wanted)
    engine = deepspeed.init_inference(model, dtype=dtype)
    assert engine.module is model and model.training  # its mode kept, as DeepSpeed's
    assert all(p.dtype == wanted for p in model.parameters())
    x = torch.randn(5, 8)
    with torch.no_grad():
        assert torch.equal(engine(x.to(wanted)), reference(x.to(wanted)))
    engine.close()


def test_settings_come_from_a_config_and_keywords_win(tmp_path):
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "tensor_parallel": {"tp_size": 1},
                                "enable_cuda_graph": False}))
    engine = deepspeed.init_inference(net(), config=str(path))
    assert next(engine.module.parameters()).dtype == torch.float32
    engine.close()
    engine = deepspeed.init_inference(net(), config={"dtype": "fp32"}, dtype=torch.bfloat16)
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    engine.close()


def test_generate_runs_the_model_as_it_is_written():
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="replace_with_kernel_inject has no effect here"):
        engine = deepspeed.init_inference(model, dtype=torch.float32,
                                          replace_with_kernel_inject=True)
    prompt = torch.randint(1, 32, (2, 5))
    ours = engine.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, reference.generate(prompt, max_new_tokens=6, do_sample=False))
    engine.close()


@pytest.mark.parametrize("settings, error, match", [
    ({}, ValueError, r"dtype torch.float16 \(DeepSpeed's default\) on a CPU model"),
    ({"dtype": torch.int8}, ValueError, "int8 quantized inference is not supported"),
    ({"dtype": "fp8"}, ValueError, "init_inference: dtype must name fp32, bf16 or fp16"),
    ({"dtype": torch.float32, "tensor_parallel": {"tp_size": 2}}, NotImplementedError,
     "tensor_parallel asks for more than one rank per model"),
    ({"dtype": torch.float32, "mp_size": 2}, NotImplementedError, "mp_size asks for more"),
    ({"dtype": torch.float32, "checkpoint": "ckpt.json"}, NotImplementedError,
     "checkpoint is not supported .load the weights into the model"),
    ({"dtype": torch.float32, "zero": {"stage": 3}}, NotImplementedError,
     r"zero.inference\(model, stage=3, offload_param=...\)"),
    ({"dtype": torch.float32, "replace_with_kernal_inject": True}, ValueError,
     "unknown setting.s. replace_with_kernal_inject"),
])
def test_what_it_cannot_do_is_refused_by_name(settings, error, match):
    model = net()
    with pytest.raises(error, match=match):
        deepspeed.init_inference(model, **settings)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())

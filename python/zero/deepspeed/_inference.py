"""deepspeed.init_inference on zero's engine: the model wrapped for
inference as DeepSpeed-Inference wraps it without kernel injection,
replicated on every rank (zero.inference at stage 0) in the dtype asked
for. Its settings come as DeepSpeed's: a config (dict or JSON path) and
keyword arguments, the keywords winning. What changes results or needs
DeepSpeed's kernels and tensor-parallel machinery is refused by name; the
speed knobs of kernel injection are accepted and have no effect, with one
warning ([Note: init_inference] below)."""
from __future__ import annotations

import json
import os

import torch

from zero._warnings import warn_user
from zero.config._config import DTYPES
from zero.config._deepspeed_config import dtype_name
from zero.engine._initialize import inference

# [Note: init_inference]
# DeepSpeed 0.19.8's InferenceEngine without kernel injection casts the
# model to `dtype` (default fp16, which its CPU accelerator refuses: "Data
# type torch.float16 is not supported by cpu accelerator"), leaves the
# module's train/eval mode as it is and runs its forward as written. Here:
# the same dtype rule (fp16 refused on a CPU model the same way), the mode
# kept, every rank holding the whole model (stage 0). Kernel injection
# (replace_with_kernel_inject) swaps in DeepSpeed's fused CUDA modules:
# faster, same results up to rounding, so it is accepted and the model runs
# as written, with a warning; tensor-parallel sizes above 1, quantization,
# MoE and checkpoint loading are refused by name.
_NO_EFFECT = {"replace_with_kernel_inject", "kernel_inject", "enable_cuda_graph", "use_triton",
              "triton_autotune", "max_out_tokens", "max_tokens", "min_out_tokens",
              "min_tokens", "return_tuple", "triangular_masking", "tm", "replace_method",
              "injection_policy", "injection_dict", "injection_policy_tuple",
              "transposed_mode", "keep_module_on_host", "set_empty_params"}
_REFUSED = {
    "checkpoint": "load the weights into the model before init_inference (torch.load with "
                  "weights_only=True, or from_pretrained)",
    "base_dir": "load the weights into the model before init_inference",
    "checkpoint_config": "load the weights into the model before init_inference",
    "ckpt_config": "load the weights into the model before init_inference",
    "save_mp_checkpoint_path": "no tensor-parallel checkpoint is written",
    "quant": "quantized inference is not supported",
    "moe": "DeepSpeed's MoE inference is not supported",
    "zero": "for ZeRO-Inference (parameters partitioned or offloaded) call "
            "zero.inference(model, stage=3, offload_param=...)",
    "config": "a model config for kernel injection is not used",
    "args": "a model config for kernel injection is not used",
}
_PARALLEL = {"tensor_parallel", "tp", "mp_size", "mpu", "ep_size", "ep_group", "ep_mp_group",
             "moe_experts", "moe_type", "training_mp_size"}
_DTYPES = {dtype: name for name, dtype in DTYPES.items()}


def init_inference(model, config=None, **kwargs):
    """DeepSpeed's init_inference(model, config=None, **kwargs): zero's
    engine over `model`, whose forward and generate run it; engine.module
    is the model."""
    settings = _settings(config, kwargs)
    precision = _precision(settings.pop("dtype", torch.float16))
    _check_parallel(settings)
    for key, why in _REFUSED.items():
        if settings.get(key) not in (None, {}, False, "", []):
            raise NotImplementedError(f"init_inference: {key} is not supported ({why})")
        settings.pop(key, None)
    unknown = sorted(set(settings) - _NO_EFFECT)
    if unknown:
        raise ValueError(f"init_inference: unknown setting(s) {', '.join(unknown)}; DeepSpeed "
                         f"0.19.8's are dtype, tensor_parallel and {', '.join(sorted(_REFUSED))}"
                         f", and the kernel-injection knobs {', '.join(sorted(_NO_EFFECT))}")
    if settings.get("replace_with_kernel_inject") or settings.get("kernel_inject"):
        warn_user("init_inference: replace_with_kernel_inject has no effect here; the model "
                  "runs its own modules (DeepSpeed's kernels compute the same up to rounding)",
                  UserWarning)
    if precision == "fp16" and not _on_cuda(model):
        raise ValueError("init_inference: dtype torch.float16 (DeepSpeed's default) on a CPU "
                         "model; pass dtype=torch.bfloat16 or torch.float32 (DeepSpeed's CPU "
                         "accelerator refuses fp16 too)")
    training = model.training
    engine = inference(model, stage=0, precision=precision)
    return engine.train(training)  # DeepSpeed leaves the mode as it was


def _settings(config, kwargs) -> dict:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"init_inference: config must be a dict or a JSON file's path, got "
                        f"{type(config).__name__}")
    return {**(config or {}), **kwargs}


def _precision(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES:
            raise ValueError(f"init_inference: dtype must be torch.float32, torch.bfloat16 or "
                             f"torch.float16, got {dtype} (int8 quantized inference is not "
                             "supported)")
        return _DTYPES[dtype]
    return dtype_name(dtype, "init_inference: dtype")


def _check_parallel(settings):
    """tensor_parallel {"tp_size": 1} and mp_size 1 mean one rank holds the
    whole model: accepted; more is refused."""
    for key in sorted(_PARALLEL & set(settings)):
        value = settings.pop(key)
        if key in ("tensor_parallel", "tp") and isinstance(value, dict):
            size = value.get("tp_size", 1)
            extra = sorted(set(value) - {"tp_size", "enabled", "tp_grain_size"})
            if extra:
                raise NotImplementedError(f"init_inference: {key}.{extra[0]} is not supported")
        elif key in ("mp_size", "ep_size", "training_mp_size"):
            size = value
        else:
            size = 1 if value in (None, [1], "standard") else 2
        if size != 1:
            raise NotImplementedError(
                f"init_inference: {key} asks for more than one rank per model (DeepSpeed-"
                "Inference's tensor or expert parallelism), which is not supported; shard a "
                "model over a mesh's tp dimension with zero.parallel and zero.inference, or "
                "partition it with zero.inference(model, stage=3)")


def _on_cuda(model) -> bool:
    return any(p.is_cuda for p in model.parameters())

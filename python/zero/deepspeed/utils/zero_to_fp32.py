"""deepspeed.utils.zero_to_fp32: the whole fp32 model from a checkpoint
that save_checkpoint wrote (zero's format, any world size and stage: the
same as zero.checkpoint.consolidate). DeepSpeed's own checkpoints need
pickle to read; they are not read here."""
from __future__ import annotations

import os

import torch

from zero.checkpoint._consolidate import consolidate


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None,
                                             exclude_frozen_parameters=False,
                                             lazy_mode=False) -> dict:
    """The model's state dict in fp32 from <checkpoint_dir>/<tag> (default:
    the tag in <checkpoint_dir>/latest), on the CPU."""
    whole = consolidate(checkpoint_dir, tag, with_optimizer=False)
    state = whole["model"]
    if exclude_frozen_parameters:
        params = whole["meta"]["params"]
        frozen = {key for key, kind, name in whole["meta"]["state_dict"]
                  if kind == "param" and not params[name]["trainable"]}
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir,
                                               max_shard_size="5GB", safe_serialization=False,
                                               tag=None, exclude_frozen_parameters=False):
    """Write the fp32 state dict into output_dir: model.safetensors with
    safe_serialization, else pytorch_model.bin (torch.save of tensors
    only). One file whatever max_shard_size says."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag,
                                                     exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file
        # safetensors refuses tensors that share memory (tied weights)
        save_file({k: v.contiguous().clone() for k, v in state.items()},
                  os.path.join(output_dir, "model.safetensors"))
    else:
        torch.save(state, os.path.join(output_dir, "pytorch_model.bin"))


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load the checkpoint's fp32 weights into `model` (moved to the CPU,
    as DeepSpeed's function leaves it) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model

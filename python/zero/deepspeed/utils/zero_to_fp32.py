"""deepspeed.utils.zero_to_fp32: the whole fp32 model from a checkpoint
that save_checkpoint wrote (zero's format, any world size and stage: the
same as zero.checkpoint.consolidate). DeepSpeed's own checkpoints need
pickle to read; they are not read here."""
from __future__ import annotations

import argparse
import os

import torch

from zero.checkpoint._command import _check_output
from zero.checkpoint._consolidate import consolidate
from zero.checkpoint._format import resolve_tag


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
    only), and return the file's path. One file whatever max_shard_size
    says."""
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    # not over a file of the checkpoint it reads (nor any checkpoint's)
    _check_output(os.path.join(output_dir, name), resolve_tag(checkpoint_dir, tag),
                  checkpoint_dir)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag,
                                                     exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file
        # safetensors refuses tensors that share memory (tied weights)
        save_file({k: v.contiguous().clone() for k, v in state.items()},
                  os.path.join(output_dir, name))
    else:
        torch.save(state, os.path.join(output_dir, name))
    return os.path.join(output_dir, name)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load the checkpoint's fp32 weights into `model` (moved to the CPU,
    as DeepSpeed's function leaves it) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv=None) -> int:
    """The command of the zero_to_fp32.py that save_checkpoint leaves in the
    save directory, with DeepSpeed's script's arguments
    (checkpoint/_recovery_script.py)."""
    parser = argparse.ArgumentParser(
        prog="zero_to_fp32.py",
        description="Write the fp32 model of a zero checkpoint (any world size and stage) "
                    "as pytorch_model.bin, or model.safetensors with --safe_serialization.")
    parser.add_argument("checkpoint_dir", help="the directory given to save_checkpoint "
                                               "(it holds `latest` and the tag directories)")
    parser.add_argument("output_dir", help="the directory to write the model file into")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="accepted as DeepSpeed's; one file is written whatever it says")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write model.safetensors instead of pytorch_model.bin")
    parser.add_argument("-t", "--tag", default=None,
                        help="which checkpoint (default: the one `latest` names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out the parameters that were not trained")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted as DeepSpeed's")
    args = parser.parse_args(argv)
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, args.max_shard_size, args.safe_serialization,
            args.tag, args.exclude_frozen_parameters)
    except (ValueError, OSError) as error:  # OSError: FileNotFoundError too
        parser.error(str(error))
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

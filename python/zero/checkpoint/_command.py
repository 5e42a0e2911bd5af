"""`python -m zero.checkpoint`: a checkpoint's model written as one fp32
torch state dict (the --with-optimizer flag adds torch.optim's)."""
from __future__ import annotations

import argparse
import os

import torch

from zero.checkpoint._consolidate import read_checkpoint
from zero.checkpoint._format import LATEST_FILE, META_FILE, resolve_tag


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero.checkpoint",
        description="Write a zero checkpoint's model as one fp32 torch state dict.")
    parser.add_argument("save_dir", help="the directory given to engine.save_checkpoint")
    parser.add_argument("output", help="the .pt file to write (torch.save)")
    parser.add_argument("--tag", default=None, help="which checkpoint (default: latest)")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="write {'model', 'optimizer'} instead of the model alone")
    args = parser.parse_args(argv)
    try:
        path = resolve_tag(args.save_dir, args.tag)
        _check_output(args.output, path, args.save_dir)
        state = read_checkpoint(path, args.with_optimizer)
        out = {"model": state["model"], "optimizer": state["optimizer"]} \
            if args.with_optimizer else state["model"]
        _save(out, args.output)
    except (ValueError, OSError) as error:  # OSError: FileNotFoundError too
        parser.error(str(error))
    # a module's extra state may be any plain value (a dict) beside the tensors
    tensors = [t for t in state["model"].values() if isinstance(t, torch.Tensor)]
    print(f"wrote {args.output}: {len(tensors)} tensors, "
          f"{sum(t.numel() for t in tensors):,} elements")
    return 0


def _check_output(output, tag_dir, save_dir):
    """The output must not replace a file of the checkpoint it is made of."""
    out, tag_dir = os.path.realpath(output), os.path.realpath(tag_dir)
    ours = [os.path.join(tag_dir, f) for f in os.listdir(tag_dir)]
    ours.append(os.path.join(save_dir, LATEST_FILE))
    if os.path.commonpath([out, tag_dir]) == tag_dir or any(_same_file(f, out) for f in ours):
        raise ValueError(f"output {output!r} would overwrite the checkpoint in {tag_dir!r}; "
                         "write it outside the checkpoint's tag directory")
    # nor another checkpoint directory's `latest` (its save_dir then named
    # no tag: every later load of it failed)
    if os.path.basename(out) == LATEST_FILE and _holds_tags(os.path.dirname(out)):
        raise ValueError(f"output {output!r} would replace the 'latest' of the zero checkpoint "
                         f"directory {os.path.dirname(out)!r}; write it elsewhere")
    # nor a file of another checkpoint: one in a directory that holds a
    # zero checkpoint (another tag's), which it destroyed
    holder = os.path.dirname(out)
    while True:
        if os.path.isfile(os.path.join(holder, META_FILE)):
            raise ValueError(f"output {output!r} is inside the zero checkpoint {holder!r}; "
                             "write it outside every checkpoint's tag directory")
        parent = os.path.dirname(holder)
        if parent == holder:
            break
        holder = parent


def _holds_tags(directory) -> bool:
    """directory holds a zero checkpoint's tag directory."""
    try:
        return any(os.path.isfile(os.path.join(directory, name, META_FILE))
                   for name in os.listdir(directory))
    except OSError:
        return False


def _same_file(path, real) -> bool:
    """path is the file at the resolved path `real`, also through a link."""
    return os.path.realpath(path) == real or \
        os.path.exists(path) and os.path.exists(real) and os.path.samefile(path, real)


def _save(obj, output):
    """torch.save reports a missing directory or a failed write as a
    RuntimeError; an OSError naming the output instead."""
    try:
        torch.save(obj, output)
    except RuntimeError as error:
        raise OSError(f"cannot write output {output!r}: {error}") from error

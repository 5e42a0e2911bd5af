"""zero.checkpoint: a checkpoint of engine.save_checkpoint as plain torch
state dicts, with no engine, no process group and any number of processes
(one is enough):

    from zero.checkpoint import consolidate
    state = consolidate("ckpt/")              # the tag in ckpt/latest
    model.load_state_dict(state["model"])     # fp32, every key of the model
    optimizer.load_state_dict(state["optimizer"])  # a torch.optim optimizer

or from a shell, the model's fp32 state dict alone:

    python -m zero.checkpoint ckpt/ model.pt [--tag TAG] [--with-optimizer]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from zero._checkpoint_format import LATEST_FILE, CheckpointReader, resolve_tag

__all__ = ["consolidate"]


def _optimizer_state_dict(reader) -> dict:
    """torch.optim's layout: params numbered through the groups in order;
    a state entry for every trainable parameter."""
    meta = reader.meta
    state, groups, index = {}, [], 0
    for saved in meta["groups"]:
        numbers = []
        for name in saved["param_names"]:
            if meta["params"][name]["trainable"]:
                sgd = meta["optimizer"] == "sgd"
                entry = {} if sgd else {"step": torch.tensor(float(saved["step"]))}
                # an SGD group that never used its momentum buffer (step 0:
                # counts_as_step) has none in torch
                if not (sgd and saved["step"] == 0):
                    for key in saved["states"]:
                        entry[key] = reader.read(name, key)
                state[index] = entry
            numbers.append(index)
            index += 1
        groups.append({**saved["hyper"], "params": numbers})
    return {"state": state, "param_groups": groups}


def consolidate(save_dir, tag=None, with_optimizer: bool = True) -> dict:
    """{"model": the fp32 state dict (every key, tied weights under each
    name), "optimizer": torch.optim's state dict for the saved optimizer
    (None if with_optimizer is False), "lr_scheduler", "client_state",
    "global_steps", "meta": what else the checkpoint records}."""
    return _read(resolve_tag(save_dir, tag), with_optimizer)


def _read(path, with_optimizer) -> dict:
    reader = CheckpointReader(path)
    meta = reader.meta
    values = {name: reader.read(name) for name in meta["params"]}
    model = {}
    for key, kind, name in meta["state_dict"]:
        if kind == "param":
            model[key] = values[name]
        else:  # floating buffers in fp32 too, as engine.full_state_dict() gives them
            buffer = meta["buffers"][key]
            model[key] = buffer.float() if buffer.is_floating_point() else buffer
    optimizer = _optimizer_state_dict(reader) if with_optimizer else None
    rest = {k: v for k, v in meta.items() if k not in ("buffers", "client_state",
                                                        "lr_scheduler")}
    return {"model": model, "optimizer": optimizer, "lr_scheduler": meta["lr_scheduler"],
            "client_state": meta["client_state"],
            "global_steps": meta["engine"]["global_steps"], "meta": rest}


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
        state = _read(path, args.with_optimizer)
        out = {"model": state["model"], "optimizer": state["optimizer"]} \
            if args.with_optimizer else state["model"]
        _save(out, args.output)
    except (ValueError, OSError) as error:  # OSError: FileNotFoundError too
        parser.error(str(error))
    n = sum(t.numel() for t in state["model"].values())
    print(f"wrote {args.output}: {len(state['model'])} tensors, {n:,} elements")
    return 0


def _check_output(output, tag_dir, save_dir):
    """The output must not replace a file of the checkpoint it is made of."""
    out, tag_dir = os.path.realpath(output), os.path.realpath(tag_dir)
    ours = [os.path.join(tag_dir, f) for f in os.listdir(tag_dir)]
    ours.append(os.path.join(save_dir, LATEST_FILE))
    if os.path.commonpath([out, tag_dir]) == tag_dir or any(_same_file(f, out) for f in ours):
        raise ValueError(f"output {output!r} would overwrite the checkpoint in {tag_dir!r}; "
                         "write it outside the checkpoint's tag directory")


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


if __name__ == "__main__":
    sys.exit(main())

"""How a checkpoint file zero cannot read is named: damaged (truncated,
not an archive), in torch's legacy format, or holding objects that would
run code; and a DeepSpeed checkpoint given where a zero one is read.
Nothing here unpickles anything: a bare pickle's opcodes are
read with pickletools, never run, and torch's weights-only refusal is
told from damaged bytes by the CRCs the writer recorded."""
from __future__ import annotations

import os
import pickle
import pickletools
import re

from zero.checkpoint._zip_checksums import damaged_record


def unreadable(file, error) -> ValueError:
    """torch's own words are left out where they tell the reader to load
    the file with weights_only=False (which would run its code)."""
    said = str(error)
    why = type(error).__name__ + ("" if "weights_only" in said else f": {said}")
    return ValueError(f"checkpoint file {file!r} cannot be read, so it is truncated or "
                      f"damaged ({why}); load another checkpoint")


def runs_code(file) -> ValueError:
    return ValueError(f"checkpoint file {file!r} is refused: it holds objects that would run "
                      "code when loaded; zero never loads such files")


# the first pickle of torch.save's legacy (pre-zip) format is this number
_LEGACY_MAGIC = 0x1950a86a20f9469cfc6c
_CODE_OPS = {"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD"}


def not_an_archive(file) -> ValueError:
    """zero writes torch.save's zip archives only. A bare pickle that
    imports or calls anything is named for what it is (its opcodes are
    read, never run); anything else is a damaged (truncated) archive."""
    try:
        with open(file, "rb") as f:
            found = [(op.name, arg) for op, arg, _pos in pickletools.genops(f)]
    except Exception:  # noqa: BLE001 - not a pickle at all: nothing to name
        found = []
    ops = {name for name, _arg in found}
    if any(arg == _LEGACY_MAGIC for _name, arg in found if isinstance(arg, int)):
        # torch.save(..., _use_new_zipfile_serialization=False): its later
        # pickles name torch's own functions whether or not they run code
        return ValueError(
            f"checkpoint file {file!r} is in torch's legacy format (torch.save with "
            "_use_new_zipfile_serialization=False), which zero does not read: zero writes and "
            "reads torch.save's zip archives only; load a checkpoint zero saved")
    if ops & _CODE_OPS:
        return runs_code(file)
    return ValueError(f"checkpoint file {file!r} cannot be read, so it is truncated or "
                      "damaged (it is not a torch.save zip archive); load another checkpoint")


def holds_code(file, error) -> bool:
    """Whether torch's weights-only loader refused `file` for what its
    pickle asks to run (a global outside its allow-list) rather than for
    damaged bytes: the refusal, over a file whose records match the
    CRC-32 its writer recorded."""
    if not isinstance(error, pickle.UnpicklingError) or "weights_only" not in str(error):
        return False
    try:
        return damaged_record(file) is None
    except ValueError:  # an archive too damaged to check: damaged
        return False


def holds_deepspeed_files(path) -> bool:
    try:
        return os.path.isdir(path) and any(f.endswith("_model_states.pt")
                                           for f in os.listdir(path))
    except OSError:
        return False


def _numbers_in_order(path):
    """global_step9 before global_step10: the digits compared as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", os.path.basename(path))]


def deepspeed_tags(save_dir) -> list:
    """save_dir itself when it is a DeepSpeed tag directory, else the tag
    directories in it that hold DeepSpeed's files (a DeepSpeed checkpoint
    directory, with or without its `latest`), oldest first by the numbers
    in their names."""
    if holds_deepspeed_files(save_dir):
        return [save_dir]
    try:
        with os.scandir(save_dir) as entries:
            return sorted((e.path for e in entries if holds_deepspeed_files(e.path)),
                          key=_numbers_in_order)
    except OSError:
        return []


def deepspeed_refusal(save_dir) -> str:
    """What to do with a DeepSpeed checkpoint given where a zero one is
    read: convert it (zero never unpickles DeepSpeed's files as they are),
    naming a tag when the directory has no `latest` to say which."""
    tags = deepspeed_tags(save_dir)
    which = "" if tags == [save_dir] or os.path.exists(os.path.join(save_dir, "latest")) \
        or not tags else f" --tag {os.path.basename(tags[-1])}"
    found = "" if not which else \
        f" (it has no 'latest'; its tags: {', '.join(os.path.basename(t) for t in tags)})"
    return (f"{save_dir!r} is a DeepSpeed checkpoint, not a zero one{found}: DeepSpeed's "
            "files are pickles, which zero never loads as they are (they may run code). "
            f"Convert it once: python -m zero.checkpoint.from_deepspeed {save_dir} OUT_DIR"
            f"{which} --trust-pickle, then load OUT_DIR (docs/deepspeed.md)")

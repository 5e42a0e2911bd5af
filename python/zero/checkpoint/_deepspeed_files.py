"""Reading DeepSpeed's checkpoint files without DeepSpeed and without
running code named in them.

[Note: reading DeepSpeed's pickles] A DeepSpeed checkpoint is torch.save
pickles. Beside tensors, dicts and lists they hold a few of DeepSpeed's
objects (its LossScaler, the ZeroStageEnum, fragment_address) and
whatever the user put in client_state. A plain torch.load would import
DeepSpeed (which may be absent) and call whatever the file names. Here the
file's global names are listed from its pickle opcodes first; every name
outside torch, collections and builtins gets an inert stand-in class of
the same module and name that only records what it is built from; then
torch's weights_only unpickler reads the file with those stand-ins
allowed. torch still decides for its own and the builtin names (it
refuses eval, os.system and the like), and no module named in the file is
imported. The converter still asks for --trust-pickle: the file is parsed
by a general-purpose unpickler, which is not a place for input from
someone else.

The layout, as DeepSpeed 0.19.8 writes it (read from its files here, see
tests/data/deepspeed_checkpoints):

    <dir>/latest                                   the newest tag
    <dir>/<tag>/mp_rank_00_model_states.pt         stages 0-2: the module,
        names and shapes, steps, the scheduler, client_state
    <dir>/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt
                                                   stage 3: the same, per rank
    <dir>/<tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                                   stages 1-3: rank R's
        partition of the fp32 master and the optimizer's states
"""
from __future__ import annotations

import os
import pickletools
import re
import zipfile

import torch

from zero.checkpoint._refused_files import holds_deepspeed_files

SAFE_MODULES = ("torch", "collections", "builtins", "_codecs")
MODEL_STATES = "mp_rank_00_model_states.pt"
STAGE3_MODEL_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class StandIn:
    """What a DeepSpeed (or other) object was built from: `args` (a call's
    arguments, as an enum's value) and its attributes. Never runs anything."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


def _stand_in(module: str, name: str) -> type:
    return type(name, (StandIn,), {"__module__": module, "__qualname__": name})


def _pickle_of(path: str) -> bytes:
    try:
        with zipfile.ZipFile(path) as archive:
            records = [n for n in archive.namelist() if n.endswith("/data.pkl")
                       or n == "data.pkl"]
            if len(records) != 1:
                raise ValueError(f"{path!r} is not a torch.save file (no data.pkl in it)")
            return archive.read(records[0])
    except zipfile.BadZipFile as error:
        raise ValueError(f"{path!r} is not a torch.save archive (written by torch before 1.6, "
                         "or damaged); load and save it again with that torch first") from error


_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING",
            "BINSTRING", "SHORT_BINSTRING")


def _global_names(data: bytes, path: str) -> set:
    """(module, name) of every global the pickle refers to. STACK_GLOBAL
    takes its two names from the last two pushes (strings, or memo
    references to strings); a name that cannot be told stays out, and
    torch's unpickler then refuses it."""
    names, pushed, memo = set(), [], {}
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name == "GLOBAL":
                module, _space, name = arg.partition(" ")
                names.add((module, name))
            elif op.name == "STACK_GLOBAL" and len(pushed) >= 2 and \
                    all(isinstance(s, str) for s in pushed[-2:]):
                names.add((pushed[-2], pushed[-1]))
            if op.name in _STRINGS:
                pushed.append(arg)
            elif op.name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = pushed[-1] if pushed else None
            elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                pushed.append(memo.get(arg))
            else:
                pushed.append(None)
    except Exception as error:
        raise ValueError(f"{path!r} cannot be read: its pickle is damaged ({error})") from error
    return names


def load_pickle(path: str):
    """One DeepSpeed file, read as [Note: reading DeepSpeed's pickles] says."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DeepSpeed checkpoint file {path!r} is missing")
    names = _global_names(_pickle_of(path), path)
    stand_ins = [_stand_in(module, name) for module, name in sorted(names)
                 if module.split(".")[0] not in SAFE_MODULES]
    try:
        with torch.serialization.safe_globals(stand_ins):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        lines = str(error).splitlines()
        why = next((line.strip() for line in lines if "GLOBAL" in line or "Unsupported" in line),
                   lines[0] if lines else type(error).__name__)
        raise ValueError(f"{path!r} cannot be read safely: {why}") from error


def tag_directory(ds_dir: str, tag: str | None) -> str:
    """The directory of one DeepSpeed checkpoint: `ds_dir`/<tag>, the tag
    from `latest` when none is given; or `ds_dir` itself when it is one."""
    if tag is None and holds_deepspeed_files(ds_dir):
        return ds_dir
    if tag is None:
        latest = os.path.join(ds_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"{ds_dir!r} holds no DeepSpeed checkpoint: no 'latest' "
                                    "file and no *_model_states.pt; pass the tag directory "
                                    "or --tag")
        with open(latest) as f:
            tag = f.read().strip()
    if not tag or os.sep in tag or tag in (".", ".."):
        raise ValueError(f"tag {tag!r} does not name a directory inside {ds_dir!r}")
    path = os.path.join(ds_dir, tag)
    if not holds_deepspeed_files(path):
        raise FileNotFoundError(f"{path!r} is not a DeepSpeed checkpoint directory (no "
                                "*_model_states.pt in it)")
    return path


def model_states_files(path: str) -> list:
    """The model-states file(s): one for stages 0-2, one per rank at stage 3."""
    files = os.listdir(path)
    if any(re.match(r"^mp_rank_0*[1-9]\d*_model_states\.pt$", f) or "layer_" in f
           for f in files):
        raise ValueError(f"{path!r} is a checkpoint of DeepSpeed's tensor or pipeline "
                         "parallelism (mp_rank_01 or layer_* files); the converter reads "
                         "data-parallel ZeRO checkpoints only")
    if MODEL_STATES in files:
        return [os.path.join(path, MODEL_STATES)]
    ranks = sorted((int(m.group(1)), f) for f in files
                   if (m := STAGE3_MODEL_STATES.match(f)))
    if not ranks:
        raise FileNotFoundError(f"{path!r} has no {MODEL_STATES} and no "
                                "zero_pp_rank_*_mp_rank_00_model_states.pt")
    _check_ranks([r for r, _f in ranks], path, "model states")
    return [os.path.join(path, f) for _r, f in ranks]


def optim_states_files(path: str) -> list:
    """Each rank's optimizer-states file, in rank order (empty at stage 0)."""
    ranks = sorted((int(m.group(2)), f) for f in os.listdir(path)
                   if (m := OPTIM_STATES.match(f)))
    _check_ranks([r for r, _f in ranks], path, "optimizer states")
    return [os.path.join(path, f) for _r, f in ranks]


def _check_ranks(ranks, path, what):
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise FileNotFoundError(f"{path!r} lacks the {what} of rank(s) {missing}: copy every "
                                "rank's files into it")

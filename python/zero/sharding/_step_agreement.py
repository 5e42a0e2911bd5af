"""What the ranks agree on before a step takes anything in: the parameter
writes each saw, the optimizer settings each will use, and whether any of
them refused the step. One all-reduce of five integers.

[Note: writes agreed] Every rank takes its own written values into its own
partition, so a write made on some ranks only (`if rank == 0:
model.load_state_dict(...)`), or with other values on each (an unseeded
nn.init), would leave the ranks' partitions out of step, silently: each
rank's slice of the model would come from another model. The same holds for
the optimizer's settings: each rank updates its own partition with its own
param_groups, so an lr changed on one rank only trains each slice at another
rate. And a refusal on one rank only (a bad setting there, a parameter cast
there) raised on that rank while the others went on into the gradient
reduction and waited for it for good.

And a collective call made on some ranks only (full_state_dict on rank 0,
as DDP users save) met another call's collectives on the others: numbers of
one paired with the other's, then a hang, an abort or a wrong error.

So before a step (and before a checkpoint, full_state_dict,
clip_grad_norm_ or GatheredParameters reads the partitions) each rank
hashes, into numbers below _PRIME: which call it is in, with the engine's
update and micro-step counts; the (group, parameter) names it saw written
and 64 of each one's values, strided; and, for a step, every setting of the
param groups it trains. It says whether it refuses. One all-reduce of
(refused, c, c^2, w, w^2, s, s^2) as integers tells every rank alike
whether all c, all w and all s are equal: world * sum(h^2) == sum(h)^2
exactly then (Cauchy-Schwarz). Every rank then raises, or none does. A hash
can collide (about 1 in a million); then the difference goes unseen, as it
did before the check. A call met by another rank's gradient reduction or
stage-3 gather (not an agreement) is not caught here: gloo aborts on the
size mismatch, or both wait.
"""
from __future__ import annotations

import zlib

import torch

_PRIME = 1_048_573  # below 2^20: world * sum(h^2) stays exact in int64 up to 2048 ranks
_SAMPLES = 64


class Verdict:
    """What the all-reduce told this rank: whether another rank refused,
    and whether the call, the writes and the settings were alike on every
    rank."""

    def __init__(self, other_refused, same_call, writes_alike, settings_alike):
        self.other_refused = other_refused  # how many other ranks refused
        self.same_call = same_call
        self.writes_alike = writes_alike
        self.settings_alike = settings_alike


def agree(comm, call: str, writes_hash: int, settings_hash: int, refused: bool) -> Verdict:
    comm = comm.everyone  # every data-parallel rank, the replicas too
    c = zlib.crc32(call.encode()) % _PRIME
    w, s = writes_hash % _PRIME, settings_hash % _PRIME
    totals = torch.tensor([int(refused), c, c * c, w, w * w, s, s * s], dtype=torch.int64,
                          device=comm.scalar_device)
    comm.sum_scalars_(totals)
    refusals, *sums = (int(v) for v in totals.tolist())
    alike = [comm.world * squares == total * total
             for total, squares in zip(sums[0::2], sums[1::2])]
    return Verdict(refusals - int(refused), *alike)


def agree_on_call(comm, call: str, refused: bool = False) -> int:
    """The agreement of a call that compares no writes nor settings: raises
    on every rank when the ranks are in different calls; else how many
    other ranks refused."""
    verdict = agree(comm, call, 0, 0, refused)
    if not verdict.same_call:
        raise different_calls(call)
    return verdict.other_refused


def different_calls(call: str) -> RuntimeError:
    return RuntimeError(
        f"the ranks are not in the same engine call at the same step: this rank is in {call}, "
        "another rank in another call, at another count or with other arguments. step(), "
        "full_state_dict(), "
        "save_checkpoint(), load_checkpoint(), clip_grad_norm_(), zero.GatheredParameters "
        "and, at stage 3, the forward are collectives: call them on every rank alike (not "
        "under `if rank == 0`), and step() as often on each. Nothing was taken in or "
        "updated; engine.zero_grad() on every rank drops the gradients of the backwards "
        "the ranks made since, and training goes on from there")


def other_rank_refused() -> RuntimeError:
    return RuntimeError(
        "another rank refused to go on (its own error says why); every rank stops here, "
        "and nothing was taken in or updated on any rank")


def hash_writes(written) -> int:
    """`written`: (group, unit, index in unit) of each written parameter."""
    h = 0
    for fg, unit, j in written:
        flat = unit.params[j].detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // _SAMPLES)][:_SAMPLES]
        values = sample.to(device="cpu", dtype=torch.float32).numpy().tobytes()
        h += zlib.crc32(f"{fg.index}:{unit.members.start + j}:".encode() + values)
    return h % _PRIME


def describe_settings(param_groups, indices) -> str:
    """The settings of the listed param groups, as one text that is equal on
    two ranks exactly when the settings are (the parameters left out)."""
    return "; ".join(
        f"group {i}: " + ", ".join(f"{key}={_setting_text(value)}"
                                   # str(): a group is a dict, keys of any type
                                   for key, value in sorted(param_groups[i].items(),
                                                            key=lambda item: str(item[0]))
                                   if key != "params")
        for i in indices)


def hash_settings(text: str) -> int:
    return zlib.crc32(text.encode()) % _PRIME


def _setting_text(value) -> str:
    if torch.is_tensor(value):  # a tensor lr (capturable, or a scheduler's)
        return repr(value.detach().cpu().tolist()) if value.numel() <= 16 \
            else f"tensor{tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_setting_text(v) for v in value) + ")"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__  # an object's repr can hold its address

"""zero.GatheredParameters on parameters that zero.partitioned_init built
and no engine holds yet ([Note: placeholders gathered]).

[Note: placeholders gathered] Between partitioned_init's context and
initialize, a parameter is a placeholder whose values lie in the ranks'
chunks. HuggingFace's code under DeepSpeed's zero.Init does exactly this
(`_init_weights` or `resize_token_embeddings` after construction, in
GatheredParameters(..., modifier_rank=0)): the block read the
placeholder's zeros, and a write made initialize refuse on the modifier
rank alone while the others went on into its collectives. Now the block
gathers each one's values into the parameter (a collective, in the order
the parameters were built, the same on every rank); on leaving, with
modifier_rank=r, rank r's values are broadcast and every rank keeps its
own chunk of them, and the placeholder comes back. Without a
modifier_rank a write is refused, as the engine's own block refuses one
at the next step, and the chunks keep their values."""
from __future__ import annotations

import torch

from zero.comm._comm import Comm
from zero.sharding._partitioned_init import built_in_order, sharded_record
from zero.sharding._step_agreement import agree_on_call


class GatheredPlaceholders:
    def __init__(self, params):
        """params: the block's parameters that no engine holds."""
        records = [(p, sharded_record(p)) for p in params]
        self.entries = built_in_order([(p, r) for p, r in records
                                       if r is not None and r.closed])
        self.world = self.entries[0][1].world if self.entries else 1
        self._kept = []  # (param, its placeholder data, its version after the gather)

    def enter(self):
        try:
            for p, record in self.entries:
                values = record.gather().to(getattr(record, "cast_to", record.dtype))
                placeholder = p.data
                p.data = values.clone()
                self._kept.append((p, placeholder, p._version))
        except BaseException:  # the block never runs: the placeholders back
            for p, placeholder, _version in self._kept:
                p.data = placeholder
            self._kept = []
            raise

    def leave(self, modifier_rank, failed: bool):
        """Puts the placeholders back, with rank modifier_rank's values in
        every rank's chunk (None: none, and a write is refused)."""
        if not self._kept:
            return
        comm = Comm(torch.device("cpu")) if self.world > 1 else None
        if comm is not None and modifier_rank is not None:
            failed = agree_on_call(comm, "zero.GatheredParameters (leaving, parameters "
                                   "built in zero.partitioned_init)", failed) > 0 or failed
        written = []
        try:
            for (p, record), (_p, _placeholder, version) in zip(self.entries, self._kept):
                if modifier_rank is not None and not failed:
                    values = p.data.contiguous()
                    if comm is not None:
                        comm.broadcast(values, src=modifier_rank)
                    record.store(values.to(record.dtype))
                elif p._version != version:
                    written.append(p)
        finally:
            for (p, record), (_p, placeholder, _version) in zip(self.entries, self._kept):
                p.data = placeholder
                record.version = p._version  # taken in, or refused below
            self._kept = []
        if written and not failed:
            raise RuntimeError(
                f"a parameter of shape {tuple(written[0].shape)} built in "
                "zero.partitioned_init() was written inside zero.GatheredParameters without "
                "modifier_rank, so the write was dropped (every rank keeps the values it had). "
                "Pass modifier_rank=0 to keep rank 0's values on every rank")


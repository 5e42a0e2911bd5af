"""The engine's reports: the model-state memory beside the ZeRO formula,
the last step's collectives, and the whole model's state dict (a
collective every rank calls)."""
from __future__ import annotations

import torch

from zero.checkpoint._extra_states import extra_state_modules, snapshot
from zero.engine._generation import generate
from zero.engine._memory import MemorySummary, zero_formula
from zero.sharding._param_writes import take_in_parameter_writes
from zero.sharding._units import uncompiled


class EngineReports:
    """Mixed into Engine."""

    def memory_summary(self) -> MemorySummary:
        """This rank's model-state bytes. At stage 3, `params` is the shard
        plus the persistent units, and `gathered_peak` the most bytes of
        released units gathered at once (current module plus prefetch).
        A closed engine holds nothing: its figures would be stale."""
        self._check_open()
        totals = {"params": 0, "grads": 0, "optimizer_states": 0, "offloaded": 0, "host": 0,
                  "buckets": 0, "persistent": 0, "params_offloaded": 0}
        for fg in self.groups:
            for k, v in fg.nbytes().items():
                totals[k] += v
        item = self.compute_dtype.itemsize
        totals["gathered_peak"] = self._schedule.peak_live * item if self._schedule else 0
        grouped = {id(p) for fg in self.all_groups for p in fg.params}
        frozen = 0
        if self.frozen_group is not None:
            frozen_bytes = self.frozen_group.nbytes()
            frozen = frozen_bytes["params"]
            totals["params_offloaded"] += frozen_bytes["params_offloaded"]
            totals["host"] += frozen_bytes["host"]
        frozen += sum(p.nbytes for p in self.module.parameters() if id(p) not in grouped)
        totals["model_states"] = totals["params"] + totals["grads"] + \
            totals["optimizer_states"] + totals["gathered_peak"]
        totals["frozen_params"] = frozen
        formula, expected = self._formula(totals)
        return MemorySummary(totals, formula=formula, formula_bytes=expected,
                             world_size=self._comm.world, stage=self.stage,
                             trainable_params=sum(fg.numel for fg in self.groups))

    def _formula(self, totals):
        first = self.groups[0] if self.groups else None  # none: zero.inference's engine
        return zero_formula(
            self.stage, self._comm.world, self.compute_dtype.itemsize,
            first.grad_part.element_size() if first else self.compute_dtype.itemsize,
            any(fg.master is not fg.shard for fg in self.groups),  # a master of its own
            [(fg.numel, len(fg.states)) for fg in self.groups], totals, staged=self._staged,
            shard_on_host=first.shard_on_host if first else False,
            grads_on_host=first.grads_on_host if first else False)

    def generate(self, *args, generate_fn=None, gather="auto", **kwargs):
        """The model's generate (HuggingFace's), or generate_fn(model,
        *args, **kwargs), without gradients, with a stage-3 model's
        parameters gathered once for the whole generation instead of per
        module and token ([Note: generation] in _generation.py). A
        collective at stage 3 (the gather and release); ranks may stop at
        different lengths (no synced_gpus needed). gather: "auto" gathers
        the whole model when it takes at most half the free memory, else
        unit by unit for each forward (streamed from host memory or files
        under offload_param: ZeRO-Inference); "whole" or "units" chooses."""
        self._check_open()
        return generate(self, args, kwargs, generate_fn, gather)

    def comm_summary(self) -> dict:
        """Elements and bytes per collective in the last optimizer step; at
        stage 3 also how many unit gathers were prefetched and how many
        waited on demand ("stage3_gathers"). With hybrid sharding the
        top-level figures are the partitions' group's (dp_shard) and
        "dp_replicate" holds what was summed across the replicas."""
        return self._last_comm

    def module_state_entries(self) -> dict:
        """The model's state_dict(keep_vars=True), for its names and
        buffers: at stage 3 the released parameters in it are placeholders
        (which a user's state_dict() call warns about)."""
        module = uncompiled(self.module)  # the model's names, not torch.compile's
        if self._schedule is None:
            return module.state_dict(keep_vars=True)
        self._schedule.reading_state = True
        try:
            return module.state_dict(keep_vars=True)
        finally:
            self._schedule.reading_state = False

    def full_state_dict(self) -> dict:
        """The whole model's state dict, trainable parameters in fp32 from
        the master copies (gathered from every rank), on every rank, in host
        memory whatever the model's device; a tensor-parallel parameter
        whole (its tp pieces gathered). A collective: every rank must
        call it."""
        return self._gathered_state("full_state_dict()")

    def _gathered_state(self, call: str, param_dtype=torch.float32, keep: bool = True) -> dict:
        """full_state_dict's entries for the engine call `call` (agreed over
        the ranks first, the writes made to parameters taken in), the flat
        groups' parameters cast to param_dtype as each unit arrives
        (save_16bit_model's: the compute dtype), so the fp32 values held at
        once are one unit's, not the whole model's twice over (a 0.97B
        stage-3 model peaked 7.2 GiB over its 1.8 GiB bf16 file).
        keep=False: the collectives alone, for a rank that writes nothing
        ({} returned; with tensor parallelism the pieces are still needed
        for their gathers)."""
        self._check_open()
        take_in_parameter_writes(self.all_groups, self.call_text(call))
        tp = self._tensor_parallel
        hold = keep or tp is not None
        by_id = {}
        for fg in self.all_groups:
            source = fg.master if fg.trainable else fg.shard
            for unit in fg.units:
                if fg.num_partitions == 1:  # this rank holds it whole: read in place
                    values = source[unit.shard_slice].detach()
                else:
                    values = torch.empty(unit.total, dtype=torch.float32)
                    fg.gather_unit(unit, source, values)
                if hold:
                    for j, p in enumerate(unit.params):
                        off, n = unit.offsets[j], unit.numels[j]
                        by_id[id(p)] = values[off:off + n].view(unit.shapes[j]).to(
                            device="cpu", dtype=param_dtype, copy=True)
                del values
                drop_unit_pages(fg, unit)
            fg.release_offloaded()
        full = {}
        extra = extra_state_modules(uncompiled(self.module))  # [Note: extra state]
        for name, t in self.module_state_entries().items():
            if name in extra:
                value = snapshot(t)
            elif id(t) in by_id:
                value = by_id[id(t)]
            else:
                t = t.detach()  # 16-bit floats in fp32; float64 kept
                value = t.to(device="cpu", copy=True, dtype=torch.float32 if
                             t.is_floating_point() and t.element_size() < 4 else None)
            if tp is not None:
                value = tp.whole_values(name, value)
            if keep:
                full[name] = value
        return full


def drop_unit_pages(fg, unit):
    """A unit read whole through mapped files (an offloaded master, a shard
    on a disk): its pages out of the process again, so reading the whole
    model holds one unit's ([Note: shard on a disk] in _flat_group.py)."""
    span = unit.shard_slice
    if fg.offload is not None and "master" in fg.offload.maps:
        fg.offload.drop("master", span.start, span.stop)
    fg.drop_param_pages(span)

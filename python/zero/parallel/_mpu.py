"""A Megatron-style model-parallel unit (`mpu`), as DeepSpeed takes it in
deepspeed.initialize(mpu=...), mapped onto zero's engine.

[Note: mpu] Megatron splits layers by hand: each model-parallel rank holds
plain tensors, its slices of the split weights (marked with the attribute
`tensor_model_parallel = True`, or DeepSpeed's older `model_parallel`),
and whole copies of the rest (LayerNorms, biases added after a
reduction); its own autograd functions do the collectives. The mpu names
the process groups. zero maps it so:
- ZeRO partitions over `mpu.get_data_parallel_group()` only (the engine's
  mesh is that group), as DeepSpeed does;
- the global gradient norm counts a split parameter's slice on every
  model-parallel rank and a whole copy once (weighted 1 / model-parallel
  size before the sum over the model-parallel group), so clipping sees the
  unsplit model's norm: the same rule as zero's DTensor tensor
  parallelism (step/_clipping.model_parallel_sumsq, which reads
  `world`, `comm` and `is_sharded` from this object);
- checkpoints: each model-parallel rank's slices are their own zero
  checkpoint, in <save_dir>/mp_rank_<RR>/ (DeepSpeed writes
  mp_rank_<RR>_model_states.pt side by side the same way); each loads at
  any data-parallel world size and stage, with the same model-parallel
  size. consolidate() of one gives that rank's slices.
Pipeline groups of the mpu (a pipeline world above 1) are refused: zero's
pipeline parallelism is torch's (parallel/_pipeline.py).
"""
from __future__ import annotations

import os

from zero.comm._comm import Comm

SPLIT_MARKS = ("tensor_model_parallel", "model_parallel")


def _call(mpu, *names):
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    raise ValueError(f"mpu: it has none of {', '.join(names)}; deepspeed.initialize(mpu=) "
                     "takes a Megatron-style model-parallel unit")


class MegatronParallel:
    """Built from the mpu before the engine (which partitions over
    dp_group), then connected to the engine's device."""

    def __init__(self, mpu, module):
        pipeline = getattr(mpu, "get_pipeline_model_parallel_world_size", None)
        if callable(pipeline) and pipeline() > 1:
            raise NotImplementedError(
                "mpu: its pipeline-parallel world is above 1; zero does not run Megatron's "
                "pipeline schedule. Use torch's pipelining over zero.initialize(mesh=...) "
                "(zero.parallel.pipeline_schedule, docs/parallel.md)")
        self.dp_group = _call(mpu, "get_data_parallel_group")
        self.group = _call(mpu, "get_tensor_model_parallel_group", "get_model_parallel_group")
        self.sharded = {name for name, p in module.named_parameters()
                        if any(getattr(p, mark, False) for mark in SPLIT_MARKS)}
        self.comm = self.world = self.rank = None

    def connect(self, device) -> "MegatronParallel":
        self.comm = Comm(device, self.group)
        self.world, self.rank = self.comm.world, self.comm.rank
        return self

    def is_sharded(self, name: str) -> bool:
        """Whether this rank holds a slice of the parameter (not a copy)."""
        return name in self.sharded

    def checkpoint_dir(self, save_dir) -> str:
        return os.path.join(os.fspath(save_dir), f"mp_rank_{self.rank:02d}")

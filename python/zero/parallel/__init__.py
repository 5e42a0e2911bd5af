"""parallel: the mesh a user passes, turned into the groups zero's
collectives use (dp_replicate, dp_shard, tp, pp), and tensor and pipeline
parallelism composed with ZeRO: ready plans for torch's parallelize_module,
the local view of a DTensor model the engine trains, models cut into
pipeline stages by layers, and torch's pipeline schedules on an engine."""
from zero.parallel._pipeline import (causal_lm_loss, gpt_loss, pipeline_schedule, split_gpt,
                                     split_llama)
from zero.parallel._plans import (gpt2_plan, gpt_plan, llama_plan, parallelize_gpt,
                                  parallelize_gpt2, parallelize_llama)

__all__ = ["gpt_plan", "gpt2_plan", "llama_plan", "parallelize_gpt", "parallelize_gpt2",
           "parallelize_llama", "split_gpt",
           "split_llama", "pipeline_schedule", "gpt_loss", "causal_lm_loss"]

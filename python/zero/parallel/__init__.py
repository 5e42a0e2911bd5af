"""parallel: the mesh a user passes, turned into the groups zero's
collectives use (dp_replicate, dp_shard, tp; later pp), and tensor
parallelism composed with ZeRO: ready plans for torch's parallelize_module
and the local view of a DTensor model the engine trains."""
from zero.parallel._plans import gpt_plan, llama_plan, parallelize_gpt, parallelize_llama

__all__ = ["gpt_plan", "llama_plan", "parallelize_gpt", "parallelize_llama"]

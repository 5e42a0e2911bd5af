"""deepspeed.runtime.zero.stage_1_and_2's memory estimates, with zero's
figures for stage 2 (_estimates.py says what each column holds)."""
from __future__ import annotations

from zero.deepspeed.runtime.zero._estimates import print_table, sized_model


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """Print, for `model` at stage 2, the per-GPU and per-node host memory
    of zero's engine with and without offload_optimizer."""
    print_table(model, 2, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5):
    """The same table for a model known by its parameter count."""
    print_table(sized_model(total_params, total_params), 2, num_gpus_per_node, num_nodes,
                additional_buffer_factor)


__all__ = ["estimate_zero2_model_states_mem_needs_all_live",
           "estimate_zero2_model_states_mem_needs_all_cold"]

"""deepspeed.runtime.zero.stage3's memory estimates, with zero's figures
(_estimates.py says what each column holds)."""
from __future__ import annotations

from zero.deepspeed.runtime.zero._estimates import print_table, sized_model


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """Print, for `model` at stage 3, each offload option's per-GPU and
    per-node host memory for zero's engine."""
    print_table(model, 3, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params,
                                                   num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """The same table for a model known by its sizes."""
    print_table(sized_model(total_params, largest_layer_params), 3, num_gpus_per_node,
                num_nodes, additional_buffer_factor)


__all__ = ["estimate_zero3_model_states_mem_needs_all_live",
           "estimate_zero3_model_states_mem_needs_all_cold"]

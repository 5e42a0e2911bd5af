"""DeepSpeed's estimate_zero2/3_model_states_mem_needs_* tables, with zero's
own figures: each row is what zero.estimate_memory says one rank of zero's
engine holds for that option (bf16 compute with fp32 masters and AdamW,
the setting DeepSpeed's table assumes), per GPU and per node's host
memory. The columns:
- per GPU: the rank's model states on the device (its parameter shard,
  gradient partition and optimizer states where they are not offloaded)
  plus, at stage 3, the largest unit gathered in bf16 (DeepSpeed counts
  its largest layer in fp32);
- per CPU: the host memory of a node's num_gpus_per_node ranks: their
  offloaded states (estimate_memory's `host`) plus the model each process
  builds before initialize takes it (fp32, whole; 1/N of it under
  zero_init, zero.partitioned_init's), times additional_buffer_factor, the
  margin DeepSpeed's table applies to this column too.
The _all_cold forms describe the model by its sizes: a meta model of that
many parameters in layers of at most largest_layer_params each."""
from __future__ import annotations

import math

import torch
from torch import nn

from zero.engine._estimate import estimate_memory

_GB = 2 ** 30


def model_sizes(model) -> tuple:
    """(its parameters, counted once if tied; the most a module holds itself)."""
    total = sum({p.data_ptr() if p.device.type != "meta" else id(p): p.numel()
                 for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False))
                   for m in model.modules()), default=0)
    return total, largest


def sized_model(total_params: int, largest_layer_params: int) -> nn.Module:
    """A meta model of total_params in layers of at most largest_layer_params."""
    for name, value in (("total_params", total_params),
                        ("largest_layer_params", largest_layer_params)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if largest_layer_params > total_params:
        raise ValueError(f"largest_layer_params ({largest_layer_params}) is more than "
                         f"total_params ({total_params})")
    model = nn.Module()
    layers = math.ceil(total_params / largest_layer_params)
    for i in range(layers):
        size = min(largest_layer_params, total_params - i * largest_layer_params)
        layer = nn.Module()
        layer.weight = nn.Parameter(torch.empty(size, device="meta"))
        model.add_module(f"layer{i}", layer)
    return model


def _check_setup(num_gpus_per_node, num_nodes, additional_buffer_factor):
    for name, value in (("num_gpus_per_node", num_gpus_per_node), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(additional_buffer_factor, bool) or \
            not isinstance(additional_buffer_factor, (int, float)) or \
            not additional_buffer_factor >= 1:
        raise ValueError(f"additional_buffer_factor must be a number >= 1, got "
                         f"{additional_buffer_factor!r}")


def rows(model, stage, num_gpus_per_node, num_nodes, additional_buffer_factor) -> list:
    """[(per CPU bytes, per GPU bytes, options text)] in DeepSpeed's order."""
    _check_setup(num_gpus_per_node, num_nodes, additional_buffer_factor)
    world = num_gpus_per_node * num_nodes
    total, largest = model_sizes(model)
    options = [("cpu", "cpu"), ("cpu", "none"), ("none", "none")] if stage == 3 else \
        [("cpu", None), ("none", None)]
    out = []
    for optimizer_device, param_device in options:
        settings = {"offload_optimizer": {"device": optimizer_device}}
        if param_device is not None:
            settings["offload_param"] = {"device": param_device}
        summary = estimate_memory(model, world, stage=stage, precision="bf16", device="cuda",
                                  **settings)
        gpu = summary["model_states"] + (2 * largest if stage == 3 else 0)
        for zero_init in ((True, False) if stage == 3 else (False,)):
            built = 4 * total // world if zero_init else 4 * total
            cpu = int((summary["host"] + built) * num_gpus_per_node * additional_buffer_factor)
            text = f"offload_optimizer={optimizer_device:4}"
            if param_device is not None:
                text = f"offload_param={param_device:4}, {text}, zero_init={int(zero_init)}"
            out.append((cpu, gpu, text))
    return out


def print_table(model, stage, num_gpus_per_node, num_nodes, additional_buffer_factor):
    table = rows(model, stage, num_gpus_per_node, num_nodes, additional_buffer_factor)
    total, largest = model_sizes(model)
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    layer = f", {int(largest / 1e6)}M largest layer params" if stage == 3 else ""
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
          f"SW: Model with {int(total / 1e6)}M total params{layer}.\n"
          "(zero's engine: bf16 with fp32 masters and AdamW, from zero.estimate_memory)")
    print("  per CPU  |  per GPU |   Options")
    for cpu, gpu, text in table:
        print(f" {cpu / _GB:7.2f}GB | {gpu / _GB:6.2f}GB | {text}")

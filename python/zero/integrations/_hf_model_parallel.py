"""ZeroTrainer with a tensor-parallel model (zero_options={"mesh": mesh},
the model parallelized over mesh["tp"] by zero.parallel's plans or
parallelize_module): what the Trainer must do differently.

- Data: accelerate shards each data loader over every process, but the tp
  ranks of one data-parallel place must read the same batches (their
  DTensors compute one model on one input). This Trainer's accelerator
  shards over the mesh's data-parallel ranks instead (accelerate's own
  prepare_data_loader, given the data-parallel index and count).
- Evaluation gathers what each data-parallel place computed, once: the
  tp ranks' copies would be counted again, and accelerate's trimming of
  the last batch's padding (it keeps the data set's remainder, counted
  over the data-parallel ranks) would keep copies in place of samples
  (measured: another eval loss than one process on 13 samples).
- The vocabulary-parallel loss (a plan's loss_parallel=True): each
  training step, and each evaluation step, runs under torch's
  loss_parallel(); the losses the Trainer adds up come back as plain
  tensors, and the logits it gathers for metrics whole.
- Pipeline parallelism is refused: the Trainer runs one forward and one
  backward of the whole model a step, where a pipeline stage needs a
  schedule (zero.parallel.pipeline_schedule in one's own loop).
"""
from __future__ import annotations

from zero.parallel._mesh import data_parallel_place, data_parallel_representatives


def refuse_pipeline(model, mesh):
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if getattr(model, "_zero_pipeline", None) is not None or \
            ("pp" in names and mesh["pp"].size() > 1):
        raise ValueError("ZeroTrainer with pipeline parallelism: the Trainer runs the whole "
                         "model's forward and backward each step, where a pipeline stage needs "
                         "a schedule; train a model split by zero.parallel.split_gpt / "
                         "split_llama in your own loop with zero.parallel.pipeline_schedule "
                         "(docs/parallel.md), or give ZeroTrainer a mesh without 'pp'")


def shard_data_over_data_parallel_ranks(accelerator, mesh):
    """Make `accelerator` shard the data loaders it prepares over mesh's
    data-parallel ranks (see the module's comment). False when those are
    every process, as accelerate shards already."""
    index, size = data_parallel_place(mesh)
    if (index, size) == (accelerator.process_index, accelerator.num_processes):
        return False
    from accelerate.data_loader import prepare_data_loader
    original = accelerator.prepare_data_loader

    def prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return original(data_loader, device_placement, slice_fn_for_dispatch)
        if device_placement is None:
            device_placement = accelerator.device_placement
        prepared = prepare_data_loader(
            data_loader, accelerator.device, num_processes=size, process_index=index,
            split_batches=accelerator.split_batches, put_on_device=device_placement,
            rng_types=accelerator.rng_types.copy(), dispatch_batches=accelerator.dispatch_batches,
            even_batches=accelerator.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader)
        accelerator._dataloaders.append(prepared)
        return prepared
    accelerator.prepare_data_loader = prepare
    return True


def gather_once_per_data_parallel_place(accelerator, mesh, use_gather_object=False):
    """The Trainer's gather_function for evaluation: accelerate's
    gather_for_metrics, its gather keeping the representatives' rows only
    (see the module's comment); objects (eval_use_gather_object, or data
    that is not all tensors, which accelerate gathers as objects too) are
    gathered per process and the representatives' kept the same way."""
    import torch
    reps = data_parallel_representatives(mesh)
    world = accelerator.num_processes

    def keep(gathered):
        if torch.is_tensor(gathered) and gathered.dim() > 0:
            rows = gathered.shape[0] // world
            return torch.cat([gathered[r * rows:(r + 1) * rows] for r in reps])
        if isinstance(gathered, (tuple, list)):
            return type(gathered)(keep(g) for g in gathered)
        if type(gathered) is dict:
            return {k: keep(v) for k, v in gathered.items()}
        return gathered

    def gather_for_metrics(data, use_gather_object=use_gather_object):
        if use_gather_object or not _all_tensors(data):
            return _objects_once(accelerator, reps, data)
        world_gather = accelerator.gather
        accelerator.gather = lambda value: keep(world_gather(value))
        try:
            return accelerator.gather_for_metrics(data)
        finally:
            del accelerator.gather  # the class's own again
    return gather_for_metrics


def _all_tensors(data) -> bool:
    """Whether accelerate gathers `data` as tensors (else as objects)."""
    from accelerate.utils import recursively_apply
    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def _objects_once(accelerator, reps, data):
    """accelerate's gather_for_metrics of objects (each process's list
    joined, the last batch's padding cut to the data set's remainder), with
    the representatives' lists only: accelerate's gather_object joins them
    all, so each process's goes in as one item and comes back apart."""
    from accelerate.utils import gather_object
    every = gather_object([data])  # one item a process, in process order
    joined = [item for r in reps for item in every[r]]
    state = accelerator.gradient_state
    try:
        remainder = state.remainder if state.end_of_dataloader else 0
    except Exception:  # as accelerate: a data set without a length
        remainder = 0
    return joined[:remainder] if remainder > 0 else joined


def plain(value):
    """value with each DTensor in it (a tuple's, a dict's) made a plain
    tensor: a replicated one (a loss) its local tensor, a split one (the
    logits) its whole tensor."""
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, list):
        return [plain(v) for v in value]
    if type(value) is dict:
        return {k: plain(v) for k, v in value.items()}
    return value

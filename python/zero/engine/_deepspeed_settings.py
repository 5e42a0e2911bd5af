"""DeepSpeed's engine queries of its own config (engine.zero_offload_optimizer(),
engine.steps_per_print(), engine.communication_data_type, ...) and of the
model-parallel layout (mp_world_size, get_model_parallel_rank()), answered
from zero's Config and layout, for scripts moved over from DeepSpeed. A
mixin of Engine; docs/deepspeed.md lists them."""
from __future__ import annotations

import dataclasses

from zero.checkpoint._engine_load import at_a_boundary


class DeepSpeedSettings:
    # DeepSpeed's config query methods, each answered from one Config field
    # (DeepSpeed's zero_optimization keys, stage3_ prefixes dropped)

    def zero_reduce_bucket_size(self) -> int:
        return self.config.reduce_bucket_size

    def zero_overlap_comm(self) -> bool:
        return self.config.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self.config.contiguous_gradients

    def zero_prefetch_bucket_size(self) -> int:
        return self.config.stage3_prefetch_bucket_size

    def zero_max_live_parameters(self) -> int:
        return self.config.stage3_max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config.stage3_max_reuse_distance

    def zero_param_persistence_threshold(self) -> int:
        return self.config.stage3_param_persistence_threshold

    def zero_model_persistence_threshold(self):
        return self.config.stage3_model_persistence_threshold

    def zero_offload_optimizer(self):
        """The offload_optimizer settings (.device "cpu" or "nvme",
        .nvme_path, ...), or None when the optimizer states stay on the
        device, as DeepSpeed's (None without the block)."""
        block = self.config.offload_optimizer
        return None if block.device == "none" else block

    def zero_offload_param(self):
        """The offload_param settings, or None when the parameters stay on
        the device."""
        block = self.config.offload_param
        return None if block.device == "none" else block

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer states live in host memory (DeepSpeed's:
        offload_optimizer device "cpu"; "nvme" is not counted)."""
        return self.config.offload_optimizer.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the step runs on the host (offload_optimizer "cpu" or "nvme")."""
        return self.config.offload_optimizer.device in ("cpu", "nvme")

    def dynamic_loss_scale(self) -> bool:
        """DeepSpeed's answer: True unless a static loss scale is set
        (whether or not fp16 is on, as DeepSpeed answers)."""
        return not self.config.loss_scaling.static_loss_scale

    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.config.loss_scaling.initial_scale_power)

    def steps_per_print(self):
        """The config's steps_per_print (None when not set, DeepSpeed's
        default). zero prints no periodic progress line of its own: the
        value is for the script's own logging."""
        return self.config.steps_per_print

    @property
    def communication_data_type(self):
        """The dtype gradients are reduced in: the compute dtype (fp32
        gradients under grad_accum_dtype "fp32" are reduced in fp32)."""
        return self.get_data_types()[1]

    def optimizer_params(self):
        """The config's optimizer block's params, or None without a block."""
        return None if self.config.optimizer is None else self.config.optimizer.get("params")

    def scheduler_name(self):
        """The config's scheduler block's type, or None without a block."""
        return None if self.config.scheduler is None else self.config.scheduler.get("type")

    def scheduler_params(self):
        return None if self.config.scheduler is None else self.config.scheduler.get("params")

    def set_train_batch_size(self, train_batch_size):
        """DeepSpeed's: a new global batch size, reached by changing the
        micro-batches per update (the micro-batch size stays). Must be a
        multiple of micro batch x data-parallel ranks, and given where an
        update just ended (no micro-batch accumulated since): the next
        update then comes after the new count of micro-batches. Call it
        alike on every rank."""
        micro = self.config.train_micro_batch_size_per_gpu
        if micro is None:
            raise ValueError("set_train_batch_size: the config has no "
                             "train_micro_batch_size_per_gpu (nor train_batch_size) to count "
                             "micro-batches by")
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) \
                or train_batch_size <= 0 or train_batch_size % (micro * self._comm.dp_world):
            raise ValueError(
                f"set_train_batch_size: train_batch_size must be a positive multiple of "
                f"train_micro_batch_size_per_gpu {micro} x data-parallel ranks "
                f"{self._comm.dp_world}; got {train_batch_size!r}")
        old = self.config.gradient_accumulation_steps
        if self.micro_steps % old:
            raise RuntimeError(
                f"set_train_batch_size: {self.micro_steps % old} micro-batch(es) of {old} "
                "are accumulated toward the next update; call it right after an update's "
                "engine.step()")
        accumulation = train_batch_size // (micro * self._comm.dp_world)
        self.config = dataclasses.replace(self.config, train_batch_size=train_batch_size,
                                          gradient_accumulation_steps=accumulation)
        # the count of micro-steps at a boundary of the new accumulation (as
        # a checkpoint's load rounds it), so the next update is `accumulation`
        # micro-batches away
        self.micro_steps = at_a_boundary(self.micro_steps, accumulation)

    # the model-parallel layout under DeepSpeed's names: tensor parallelism
    # (zero's plans, or a Megatron mpu given to initialize); 1 and rank 0
    # without it

    def _model_parallel(self):
        layout = self._tensor_parallel if self._tensor_parallel is not None else self._mpu
        return layout if layout is not None and layout.world is not None else None

    @property
    def mp_world_size(self) -> int:
        layout = self._model_parallel()
        return 1 if layout is None else layout.world

    def get_model_parallel_rank(self) -> int:
        layout = self._model_parallel()
        return 0 if layout is None else layout.rank

    def get_tensor_parallel_rank(self) -> int:
        return self.get_model_parallel_rank()

    def get_data_parallel_rank(self) -> int:
        return self._comm.everyone.rank

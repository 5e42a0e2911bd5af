"""DeepSpeed's engine queries and small calls, under its names, for code
moved over from DeepSpeed (docs/engine.md, "Coming from DeepSpeed"). A
mixin of Engine: it reads the engine's own attributes."""
from __future__ import annotations

import os

import torch

from zero.config._config import DTYPES
from zero.config._values import require_bool
from zero.sharding._step_agreement import agree_on_call


class LossScale(float):
    """The current loss scale (1.0 without fp16), a number that may also be
    called: DeepSpeed's engine.loss_scale() is a method, zero's a property."""
    def __call__(self) -> float:
        return float(self)


class GradNorm(float):
    """The last update's global gradient norm, a number that also answers
    .item(): DeepSpeed's engine gives a 0-dim tensor at stages 1-3, and
    scripts log `engine.get_global_grad_norm().item()`."""
    def item(self) -> float:
        return float(self)


class DeepSpeedQueries:
    # DeepSpeed's attribute: the loader deepspeed.initialize made of
    # training_data (zero.deepspeed sets it), else None
    training_dataloader = None

    def get_global_grad_norm(self) -> float:
        """The global L2 norm of the last update's gradients, before
        clipping (inf after an fp16 overflow); None before the first step."""
        norm = getattr(self, "_global_grad_norm", None)
        return None if norm is None else GradNorm(norm)

    def get_lr(self) -> list:
        return [group["lr"] for group in self.optimizer.param_groups]

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.is_accumulation_boundary

    @property
    def is_accumulation_boundary(self) -> bool:
        """Whether the coming step() updates: every
        gradient_accumulation_steps-th micro step, or what
        set_gradient_accumulation_boundary said last."""
        forced = getattr(self, "_forced_boundary", None)
        if forced is not None:
            return forced
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    @property
    def pending_micro_batches(self) -> int:
        """Micro-steps counted toward the coming update (0 at a boundary,
        and where set_gradient_accumulation_boundary sets the boundaries by
        hand: the count's remainder says nothing then)."""
        if getattr(self, "_forced_boundary", None) is not None:
            return 0
        return self.micro_steps % self.config.gradient_accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary):
        """DeepSpeed's override of the boundary: from now on step() updates
        exactly when the last value set was True (a loop whose micro batches
        per update vary); None gives the count back. Set it alike on every
        rank: the update is a collective. The gradients are still divided by
        gradient_accumulation_steps, as DeepSpeed divides them."""
        if is_boundary is not None:
            is_boundary = require_bool(is_boundary, "is_boundary")
        self._forced_boundary = is_boundary

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self):
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self):
        """micro batch x accumulation x world size, when the micro batch is
        known (the config's train_batch_size was checked against it)."""
        micro = self.config.train_micro_batch_size_per_gpu
        if micro is None:
            return self.config.train_batch_size
        return micro * self.config.gradient_accumulation_steps * self._comm.dp_world

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage (1-3) partitions anything, as DeepSpeed's."""
        return self.stage > 0

    def get_batch_info(self) -> tuple:
        """(train_batch_size, train_micro_batch_size_per_gpu,
        gradient_accumulation_steps), DeepSpeed's order."""
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps())

    def get_data_types(self) -> tuple:
        """(the compute dtype, the dtype gradients accumulate in): this
        engine's (DeepSpeed's bf16 at stage 0 accumulates in fp32 by
        default; zero in bf16 unless grad_accum_dtype says fp32)."""
        return self.compute_dtype, DTYPES[self.config.grad_accum_dtype or self.config.precision]

    def optimizer_name(self) -> str:
        """The config's optimizer type in lower case, or the class name of
        the optimizer passed in, as DeepSpeed's."""
        if self.config.optimizer is not None:  # the block built it
            return str(self.config.optimizer.get("type", "")).lower()
        return type(self.optimizer).__name__

    @property
    def monitor(self):
        """DeepSpeed's engine.monitor: write_events([(tag, value, step)])
        into the config's tensorboard/csv/wandb writers (engine/_monitor.py)."""
        from zero.engine._monitor import WRITERS, MonitorCalls
        enabled = any(kind in WRITERS for kind in (self.config.monitor or {}))
        return MonitorCalls(self._monitor, enabled)

    def wall_clock_breakdown(self) -> bool:
        """False: zero keeps no per-phase timers (the config's
        wall_clock_breakdown is accepted with a warning)."""
        return False

    def zero_optimization_partition_gradients(self) -> bool:
        return self.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.stage == 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: save_16bit_model always gathers the whole model (DeepSpeed
        needs stage3_gather_16bit_weights_on_model_save for that)."""
        return True

    def get_mom(self) -> list:
        """Per param group, Adam's betas, else SGD's momentum (None where a
        group has neither), as DeepSpeed's."""
        return [group["betas"] if "betas" in group else group.get("momentum")
                for group in self.optimizer.param_groups]

    def module_state_dict(self, destination=None, prefix="", keep_vars=False,
                          exclude_frozen_parameters=False) -> dict:
        """The whole model's state dict (full_state_dict(): fp32 values, a
        collective), with DeepSpeed's arguments; destination, keep_vars are
        accepted and unused."""
        full = self.full_state_dict()
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            full = {k: v for k, v in full.items() if k not in frozen}
        return {prefix + k: v for k, v in full.items()}

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                        exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's older name of save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def destroy(self):
        """DeepSpeed's name of close()."""
        self.close()

    def was_step_applied(self) -> bool:
        """Whether the last step() call updated the parameters: False after
        a micro-step before the boundary, an fp16 (or check_grad_overflow)
        skip, and before the first step, as DeepSpeed's."""
        return self._step_applied

    @property
    def local_rank(self) -> int:
        """The launcher's LOCAL_RANK (0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_samples(self) -> int | None:
        """Samples of the accumulation boundaries so far, as DeepSpeed counts
        them: a boundary whose fp16 step was skipped counts too ((global_steps
        + skipped_steps) x train_batch_size; global_steps counted the applied
        updates only, so a run's first skipped steps wrote the monitor's
        events at one step again and again). None when the micro batch size
        is unknown."""
        batch = self.train_batch_size()
        return None if batch is None else (self.global_steps + self.skipped_steps) * batch

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    @property
    def world_size(self) -> int:
        return self._comm.dp_world

    @property
    def global_rank(self) -> int:
        return self._comm.everyone.rank

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks (DeepSpeed's attribute)."""
        return self._comm.dp_world

    def gradient_clipping(self) -> float:
        """The clipping norm of the config (0: none), as DeepSpeed's method."""
        return self.config.gradient_clipping

    def empty_partition_cache(self):
        """DeepSpeed's: release stage 3's gathered parameters (the
        persistent ones stay, as DeepSpeed keeps them); nothing at stages
        0-2, whose parameters are never released."""
        if self._schedule is not None:
            self._schedule.release_all()

    def deepspeed_io(self, dataset, batch_size=None, route=None, pin_memory=True,
                     data_sampler=None, collate_fn=None, num_local_io_workers=None):
        """DeepSpeed's training DataLoader: batch_size (default the config's
        train_micro_batch_size_per_gpu) samples per rank, drawn by a
        DistributedSampler over the data-parallel ranks (shuffled, seed 0;
        call loader.data_sampler.set_epoch(epoch), or loader.sampler's,
        each epoch) unless
        data_sampler is given; a last, partial batch is dropped when the
        config's dataloader_drop_last says so. route is accepted and
        unused."""
        from torch.utils.data import DataLoader, DistributedSampler
        batch = batch_size or self.train_micro_batch_size_per_gpu()
        if batch is None:
            raise ValueError("deepspeed_io: no batch_size, and the config has no "
                             "train_micro_batch_size_per_gpu (nor train_batch_size) to take "
                             "it from")
        sampler = data_sampler if data_sampler is not None else DistributedSampler(
            dataset, num_replicas=self._comm.dp_world, rank=self._comm.everyone.rank)
        loader = DataLoader(dataset, batch_size=batch, sampler=sampler, collate_fn=collate_fn,
                            num_workers=num_local_io_workers or 0,
                            pin_memory=pin_memory and self.device.type == "cuda",
                            drop_last=self.config.dataloader_drop_last)
        # DeepSpeed's loader names its sampler data_sampler: scripts call
        # loader.data_sampler.set_epoch(epoch) (an AttributeError here before)
        loader.data_sampler = sampler
        return loader

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: the whole model's state dict, parameters in the
        compute dtype (bf16/fp16; fp32 under precision "fp32"), buffers in
        their own, tied parameters still one tensor, written by rank 0 to
        <save_dir>/<save_filename> with torch.save, for
        model.load_state_dict. exclude_frozen_parameters: without the
        parameters that do not require grad (an adapter's file: LoRA's
        trained weights and the buffers). A collective (the parameters are
        gathered on every rank; a failed write raises on every rank).
        Returns True."""
        require_bool(exclude_frozen_parameters, "exclude_frozen_parameters")
        # in the compute dtype unit by unit, and kept by the writing rank
        # alone: the whole fp32 state dict on every rank was 4x the file
        full = self._gathered_state("save_16bit_model()", self.compute_dtype,
                                    keep=self._comm.everyone.rank == 0)
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters(remove_duplicate=False)
                      if not p.requires_grad}
            full = {name: value for name, value in full.items() if name not in frozen}
        error = None
        if self._comm.everyone.rank == 0:
            try:
                path = os.path.join(os.fspath(save_dir), save_filename)
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                torch.save(self._state_in_module_dtypes(full), path)
            except Exception as e:  # raised on every rank below
                error = e
        failed = agree_on_call(self._comm, self.call_text("save_16bit_model()"),
                               refused=error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("save_16bit_model: rank 0 failed to write the file (its own "
                               "error says why)")
        return True

    def _state_in_module_dtypes(self, full: dict) -> dict:
        """_gathered_state's entries as the model holds them: parameters in
        the compute dtype (the flat groups' are already), buffers in their
        own dtype, one tensor for every name of a tied parameter."""
        dtypes = {name: self.compute_dtype for name, _p
                  in self.module.named_parameters(remove_duplicate=False)}
        dtypes.update((name, b.dtype) for name, b
                      in self.module.named_buffers(remove_duplicate=False))
        cast = {}  # id of full's tensor -> its cast: ties stay one tensor
        for name, value in full.items():
            dtype = dtypes.get(name, value.dtype) if value.is_floating_point() else value.dtype
            if id(value) not in cast:
                cast[id(value)] = value.to(dtype)
        return {name: cast[id(value)] for name, value in full.items()}

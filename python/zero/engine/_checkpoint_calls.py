"""engine.save_checkpoint and engine.load_checkpoint: the calls, their
arguments and refusals; the work is checkpoint/_engine_save.py and
_engine_load.py. A mixin of Engine."""
from __future__ import annotations


class CheckpointCalls:
    def save_checkpoint(self, save_dir, tag=None, client_state=None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Write this engine's training state to <save_dir>/<tag>/ (tag
        default "global_step<N>"), each rank its own partitions, and name
        the tag in <save_dir>/latest. It loads at any world size and stage
        (load_checkpoint) and into plain torch (zero.checkpoint.consolidate).
        client_state: a dict of your own (tensors, numbers, strings, lists,
        dicts), handed back by load_checkpoint. A collective; call it after
        the boundary's step(). Returns the checkpoint's directory.
        exclude_frozen_parameters (DeepSpeed's, for adapters): taken, and
        the frozen parameters are kept all the same (a checkpoint resumes
        the whole model; they are one partition among the others)."""
        self._check_open()
        from zero.config._values import require_bool
        require_bool(exclude_frozen_parameters, "exclude_frozen_parameters")
        from zero.checkpoint._engine_save import save
        if self._mpu is not None:  # [Note: mpu] one checkpoint per model-parallel rank
            save_dir = self._mpu.checkpoint_dir(save_dir)
        return save(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Restore a checkpoint of save_checkpoint (tag default: the one in
        <load_dir>/latest): weights, buffers, optimizer states and
        hyperparameters, step counts, the loss scale and the LR scheduler.
        The checkpoint may come from another world size or stage. Everything
        is checked (names, shapes, optimizer kind, files) before anything
        changes. A collective. Returns (checkpoint directory, client_state),
        or (None, None) when load_dir holds no checkpoint yet.
        load_module_strict: DeepSpeed's third argument; only True (the
        architecture must match) is supported. The arguments are DeepSpeed's,
        in its order; custom_load_fn (a function of DeepSpeed's to load its
        own module files) is refused."""
        self._check_open()
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...) is not supported: zero reads "
                             "its own checkpoint files (zero.checkpoint.consolidate gives the "
                             "weights for a loader of your own)")
        if load_module_strict is not True:
            raise ValueError(
                f"load_module_strict={load_module_strict!r}: only True is supported (every "
                "parameter of the checkpoint must match the model's by name and shape). To "
                "fine-tune with a changed head, load the consolidated weights "
                "(zero.checkpoint.consolidate) into the model with "
                "load_state_dict(strict=False) before zero.initialize")
        from zero.checkpoint._engine_load import load
        if self._mpu is not None:  # [Note: mpu] one checkpoint per model-parallel rank
            load_dir = self._mpu.checkpoint_dir(load_dir)
        return load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                    load_module_only)

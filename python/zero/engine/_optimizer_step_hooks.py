"""The optimizer's step hooks, run by engine.step() ([Note: optimizer
step hooks]).

[Note: optimizer step hooks] torch runs the hooks registered with
optimizer.register_step_pre_hook / register_step_post_hook, and the
process-wide torch.optim.optimizer.register_optimizer_step_pre_hook /
register_optimizer_step_post_hook, around optimizer.step(). Under an
engine that step is never called (engine.step() updates the partitions),
so they never ran and nothing said so: a post-hook that clamps weights,
keeps an average or counts steps for the profiler did nothing. engine.step()
runs them, with the arguments a bare optimizer.step() gives them
((optimizer,), {}):
- the pre-hooks (the process-wide ones first, as torch) at each
  accumulation boundary, before anything is reduced or changed: one that
  raises refuses the step on every rank (the ranks compare refusals
  there), and nothing changes, so the step can be called again; one that
  sets a learning rate sets it for this update. They run before the
  engine knows of an fp16 overflow, so also on a step the overflow then
  skips;
- the post-hooks (the optimizer's, then the process-wide ones) after the
  update and the gather of the new parameters, before the lr scheduler's
  step, and not on a skipped step. One that raises is raised once the
  boundary's bookkeeping is done (the scheduler stepped, the gradients
  zeroed), as the update it follows is applied.
The engine's own pre-hook (the refusal of optimizer.step()) is passed
over. Where gradients and parameters are partitioned (.grad is None at
stages 2-3; stage 3's parameters are released placeholders) the hooks see
what the model's parameters hold then."""
from __future__ import annotations

from torch.optim import optimizer as torch_optimizer

ENGINE_HOOK = "_zero_engine_hook"  # marks the engine's own step pre-hook


def run_pre_hooks(optimizer):
    """The step pre-hooks, in torch's order; raises what a hook raises."""
    args, kwargs = (optimizer,), {}
    hooks = [*getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}).values(),
             *getattr(optimizer, "_optimizer_step_pre_hooks", {}).values()]
    for hook in hooks:
        if getattr(hook, ENGINE_HOOK, False):
            continue
        result = hook(optimizer, args, kwargs)
        if result is None:
            continue
        if not (isinstance(result, tuple) and len(result) == 2):
            raise RuntimeError(f"the optimizer's step pre-hook {_name(hook)} must return None "
                               f"or a tuple of (new_args, new_kwargs), but got {result!r}")
        new_args, new_kwargs = result
        if tuple(new_args)[1:] or new_kwargs:
            raise RuntimeError(
                f"the optimizer's step pre-hook {_name(hook)} returned arguments for the step "
                f"({new_args!r}, {new_kwargs!r}), but the engine's step takes none: "
                "engine.step() updates the partitions itself")


def _post_hooks(optimizer) -> list:
    return [*getattr(optimizer, "_optimizer_step_post_hooks", {}).values(),
            *getattr(torch_optimizer, "_global_optimizer_post_hooks", {}).values()]


def has_post_hooks(optimizer) -> bool:
    return bool(_post_hooks(optimizer))


def run_post_hooks(optimizer):
    """The step post-hooks, in torch's order; returns the exception one
    raised (the hooks after it do not run, as under torch), else None."""
    args, kwargs = (optimizer,), {}
    for hook in _post_hooks(optimizer):
        try:
            hook(optimizer, args, kwargs)
        except Exception as error:  # noqa: BLE001 - raised by the caller, after the bookkeeping
            return error
    return None


def _name(hook) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)

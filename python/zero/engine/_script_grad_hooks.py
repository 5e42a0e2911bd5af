"""A post-accumulate-grad hook of the script's on a parameter at stages
2-3, named once.

[Note: the script's post-accumulate hooks] At stages 2-3 the engine's own
post-accumulate-grad hook moves each gradient into its bucket as torch
accumulates it and leaves .grad None (that is where stage 2's gradient
memory goes). A hook of the script's registered after zero.initialize
then runs after it and sees None (a grad-norm logger failed on NoneType,
or logged nothing behind `if p.grad is not None`); one registered before
sees each backward's gradient alone, not the sum over accumulation (a
hook scaling .grad scaled only the last backward's part). torch gives
such hooks no order to rely on but registration, so the engine names the
first parameter that has one, with what works instead, once: at
initialize and at the first step (hooks are usually set up before the
loop). Stages 0-1 leave .grad as torch does."""
from __future__ import annotations

from zero._warnings import warn_user


def warn_of_script_post_accumulate_hooks(engine) -> None:
    if engine._script_hooks_named or not engine.policy.reduces_in_backward:
        return
    for fg in engine.groups:
        for i, p in enumerate(fg.params):
            hooks = getattr(p, "_post_accumulate_grad_hooks", None)
            if hooks and len(hooks) > 1:  # the engine's own is one
                engine._script_hooks_named = True
                warn_user(
                    f"parameter '{fg.names[i]}' has a post-accumulate-grad hook of the "
                    f"script's: at stage {engine.stage} the engine's own hook moves each "
                    "gradient into its partition as it is accumulated and leaves .grad None, "
                    "so a hook registered after zero.initialize sees None, and one registered "
                    "before sees each backward's gradient alone (not its sum over "
                    "accumulation). A tensor hook (p.register_hook) sees and may change each "
                    "gradient before it is summed; zero.deepspeed.utils.safe_get_full_grad(p) "
                    "reads the summed one after backward; stages 0-1 keep .grad as torch does",
                    RuntimeWarning)
                return

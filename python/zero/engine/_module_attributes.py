"""The engine answers for its model's public attributes, as DeepSpeed's
engine does: a script written for DeepSpeed calls the model's own methods
and reads its attributes on the engine (DeepSpeed-Chat's
critic_engine.forward_value(...), reward_engine.num_padding_at_beginning).
Only names the engine itself lacks go to the model, and no private ones
(`_x`): the engine's own optional attributes, read with getattr(engine,
"_x", None), must not find a model's attribute of the same name."""
from __future__ import annotations

from torch import nn


class ModuleAttributes:
    """Mixed into Engine before nn.Module."""

    def __getattr__(self, name):
        try:
            return nn.Module.__getattr__(self, name)  # parameters, buffers, submodules
        except AttributeError:
            pass
        model = self.__dict__.get("_modules", {}).get("module")
        if model is not None and not name.startswith("_"):
            try:
                return getattr(model, name)
            except AttributeError:
                pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}', "
                                 f"nor has its model ({type(model).__name__})")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

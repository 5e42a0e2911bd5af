"""fp16 dynamic loss scaling, with DeepSpeed's semantics (0.19.8's rules):
the loss is multiplied by the scale before backward; a step whose gradients
hold an inf or nan is skipped; `hysteresis` overflows are tolerated before
the scale is halved (never below min_loss_scale); it doubles at the
(loss_scale_window + 1)-th step without overflow, and every
loss_scale_window steps after. With consecutive_hysteresis, a step without
overflow restores the hysteresis, so only that many overflows in a row
halve it. An overflow that would halve a scale already at min_loss_scale
raises: no scale makes those gradients finite, and skipping every step
from there on would train nothing, silently (DeepSpeed stops the run too)."""
from __future__ import annotations

from zero.config._config import LossScaling


class DynamicLossScaler:
    def __init__(self, settings: LossScaling):
        self.settings = settings
        self.dynamic = settings.static_loss_scale <= 0
        self.scale = float(2 ** settings.initial_scale_power) if self.dynamic \
            else float(settings.static_loss_scale)
        self.hysteresis_left = settings.hysteresis
        self.good_steps = 0

    def update(self, overflow: bool):
        if not self.dynamic:
            return
        s = self.settings
        if overflow:
            self.good_steps = 0
            if self.hysteresis_left <= 1:
                if self.scale <= s.min_loss_scale:
                    raise FloatingPointError(
                        f"fp16 loss scaling: the gradients overflowed (inf or nan) again with "
                        f"the loss scale at its floor, loss_scaling.min_loss_scale = "
                        f"{s.min_loss_scale}; no scale makes them finite, and every later step "
                        "would be skipped. This step was skipped and its gradients dropped "
                        "(a script that catches this error can go on with the next batch). "
                        "Look for inf or nan in the loss or the model's outputs, or train in "
                        "bf16")
                self.scale = float(max(self.scale / 2, s.min_loss_scale))
            else:
                self.hysteresis_left -= 1
            return
        self.good_steps += 1
        if s.consecutive_hysteresis:
            self.hysteresis_left = s.hysteresis
        # the first doubling after loss_scale_window + 1 good steps, as
        # DeepSpeed counts (its "stable interval" excludes the first)
        if self.good_steps > 1 and (self.good_steps - 1) % s.loss_scale_window == 0:
            self.scale *= 2
            self.hysteresis_left = s.hysteresis

    def state_dict(self):
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left,
                "good_steps": self.good_steps}

    def load_state_dict(self, state: dict):
        """A static scale stays the configured one (the checkpoint's may be
        a dynamic run's); a dynamic one goes on from the checkpoint's."""
        if not self.dynamic:
            return
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.good_steps = int(state["good_steps"])

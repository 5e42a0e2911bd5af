"""fp16 dynamic loss scaling, with DeepSpeed's semantics: the loss is
multiplied by the scale before backward; a step whose gradients hold an inf
or nan is skipped; `hysteresis` overflows are tolerated before the scale is
halved (never below min_loss_scale); after `loss_scale_window` steps with no
overflow it doubles. With consecutive_hysteresis, a step without overflow
restores the hysteresis, so only that many overflows in a row halve it."""
from __future__ import annotations

from zero.config import LossScaling


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
                self.scale = max(self.scale / 2, s.min_loss_scale)
            else:
                self.hysteresis_left -= 1
            return
        self.good_steps += 1
        if s.consecutive_hysteresis:
            self.hysteresis_left = s.hysteresis
        if self.good_steps % s.loss_scale_window == 0:
            self.scale *= 2
            self.hysteresis_left = s.hysteresis

    def state_dict(self):
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left,
                "good_steps": self.good_steps}

    def load_state_dict(self, state: dict):
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.good_steps = int(state["good_steps"])

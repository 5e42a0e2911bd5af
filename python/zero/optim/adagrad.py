"""zero.optim.Adagrad: torch.optim.Adagrad's constructor and defaults over
the C core's fused Adagrad step."""
from __future__ import annotations

from zero import _C
from zero.optim._flat import FlatOptimizer, check_hyperparameters


class Adagrad(FlatOptimizer):
    STATE_NAMES = ("sum",)

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach=None, *,
                 maximize=False, differentiable=False, fused=None):
        check_hyperparameters(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                              initial_accumulator_value=initial_accumulator_value,
                              eps=eps)
        if differentiable:
            raise ValueError("zero.optim.Adagrad does not support differentiable=True")
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value,
                        foreach=foreach, maximize=maximize, differentiable=differentiable,
                        fused=fused)
        super().__init__(params, defaults)

    def _initial_state_value(self, name, group):
        return float(group["initial_accumulator_value"])

    def _update(self, seg, group, start, stop, step, grad_scale, fresh):
        b = seg.buffers
        _C.adagrad_step(b["master"], b["grad"], b["sum"], b["copy_out"],
                        lr=float(group["lr"]), lr_decay=float(group["lr_decay"]),
                        weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                        step=step, grad_scale=grad_scale, start=start, stop=stop)

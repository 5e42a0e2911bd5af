"""zero.optim.Adagrad: torch.optim.Adagrad's constructor and defaults over
the C core's fused Adagrad step."""
from __future__ import annotations

from zero.optim._flat import FlatOptimizer
from zero.step._hyperparameters import check_hyperparameters
from zero.step._registry import ADAGRAD as ADAGRAD_SPEC


class Adagrad(FlatOptimizer):
    spec = ADAGRAD_SPEC

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

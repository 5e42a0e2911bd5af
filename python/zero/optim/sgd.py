"""zero.optim.SGD: torch.optim.SGD's constructor and defaults over the C
core's fused SGD step (momentum, dampening, Nesterov, weight decay)."""
from __future__ import annotations

from zero.optim._flat import FlatOptimizer
from zero.step._hyperparameters import check_hyperparameters
from zero.step._registry import SGD as SGD_SPEC


class SGD(FlatOptimizer):
    spec = SGD_SPEC

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None):
        check_hyperparameters(lr=lr, momentum=momentum, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening 0, got "
                             f"momentum={momentum}, dampening={dampening}")
        if differentiable:
            raise ValueError("zero.optim.SGD does not support differentiable=True")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        foreach=foreach, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)

"""zero.optim.Lion: the Lion optimizer of Chen et al., "Symbolic Discovery of
Optimization Algorithms" (2023), with the paper's defaults (lr 1e-4, betas
(0.9, 0.99)) and decoupled weight decay:

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * wd) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g
"""
from __future__ import annotations

from zero.optim._flat import FlatOptimizer
from zero.step._hyperparameters import check_hyperparameters
from zero.step._registry import LION as LION_SPEC


class Lion(FlatOptimizer):
    spec = LION_SPEC

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 maximize=False):
        check_hyperparameters(lr=lr, beta1=betas[0], beta2=betas[1],
                              weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

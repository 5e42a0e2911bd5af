"""zero.optim.SGD: torch.optim.SGD's constructor and defaults over the C
core's fused SGD step (momentum, dampening, Nesterov, weight decay)."""
from __future__ import annotations

from zero import _C
from zero.optim._flat import FlatOptimizer, check_hyperparameters


class SGD(FlatOptimizer):
    STATE_NAMES = ("momentum_buffer",)
    # as torch: the buffer starts as a parameter's first gradient when
    # momentum is first in use for it, also if switched on mid-run
    LAZY_STATES = ("momentum_buffer",)

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

    def _states_in_use(self, group):
        return self.STATE_NAMES if group["momentum"] != 0 else ()

    def _update(self, seg, group, start, stop, step, grad_scale, fresh):
        b = seg.buffers
        momentum = float(group["momentum"])
        _C.sgd_step(b["master"], b["grad"], b.get("momentum_buffer") if momentum else None,
                    b["copy_out"], lr=float(group["lr"]), momentum=momentum,
                    dampening=float(group["dampening"]),
                    weight_decay=float(group["weight_decay"]),
                    nesterov=bool(group["nesterov"]), first_step=fresh,
                    grad_scale=grad_scale, start=start, stop=stop)

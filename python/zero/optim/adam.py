"""zero.optim.Adam and zero.optim.AdamW: torch.optim's constructors and
defaults over the C core's fused Adam step (one pass per flat segment)."""
from __future__ import annotations

from zero.optim._flat import FlatOptimizer
from zero.step._hyperparameters import check_hyperparameters
from zero.step._registry import ADAM as ADAM_SPEC


def _reject_unsupported(name, capturable, differentiable):
    if capturable:
        raise ValueError(f"zero.optim.{name} does not support capturable=True "
                         "(CUDA graphs); it steps on the CPU")
    if differentiable:
        raise ValueError(f"zero.optim.{name} does not support differentiable=True")


class Adam(FlatOptimizer):
    """Adam (L2 weight decay added to the gradient), or AdamW with
    decoupled_weight_decay=True, as torch.optim.Adam."""

    spec = ADAM_SPEC

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False):
        check_hyperparameters(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                              weight_decay=weight_decay)
        _reject_unsupported(type(self).__name__, capturable, differentiable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)


class AdamW(Adam):
    """AdamW (decoupled weight decay), as torch.optim.AdamW."""

    always_decoupled = True  # whatever a loaded state dict's groups say

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True)

    def load_state_dict(self, state_dict):
        """As torch.optim.AdamW: the decay stays decoupled also when the
        state dict is Adam's (decoupled_weight_decay False in its groups)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True

"""deepspeed.ops.adam's FusedAdam and DeepSpeedCPUAdam, as DeepSpeed-Chat
builds them (`AdamOptimizer = DeepSpeedCPUAdam if offload else FusedAdam`):
each returns torch's AdamW (DeepSpeed's default adamw mode: decoupled
weight decay) or Adam (adam_w_mode=False: the decay added to the gradient)
with the same numbers, which the engine steps on its partitions in its C
core (CPU) or on the device, offloaded or not as the config says. What
torch's Adam cannot do is refused by name: bias_correction=False, and
amsgrad, which DeepSpeed's own refuse too."""
from __future__ import annotations

import torch


def FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,  # noqa: N802
              adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
    """DeepSpeed's FusedAdam(...): torch.optim.AdamW, or Adam with
    adam_w_mode=False. set_grad_none has no use here (the engine zeroes
    the gradients at each step)."""
    return _adam("FusedAdam", params, lr, bias_correction, betas, eps, adam_w_mode,
                 weight_decay, amsgrad)


def DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),  # noqa: N802
                     eps=1e-8, weight_decay=0.0, amsgrad=False, adamw_mode=True,
                     fp32_optimizer_states=True):
    """DeepSpeed's DeepSpeedCPUAdam(...): torch.optim.AdamW, or Adam with
    adamw_mode=False; the engine keeps its states in fp32 whatever
    fp32_optimizer_states says, and on the host when the config's
    offload_optimizer asks (the C core's SIMD update)."""
    return _adam("DeepSpeedCPUAdam", model_params, lr, bias_correction, betas, eps, adamw_mode,
                 weight_decay, amsgrad)


def _adam(name, params, lr, bias_correction, betas, eps, decoupled, weight_decay, amsgrad):
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False): zero steps torch's Adam, which always "
                         "corrects the moments' bias; leave bias_correction=True")
    if amsgrad:
        raise ValueError(f"{name}(amsgrad=True): DeepSpeed's {name} does not support AMSGrad "
                         "either; use torch.optim.AdamW(params, amsgrad=True)")
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    return kind(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

"""The optimizer updates of zero._C (adam_step, sgd_step, adagrad_step,
lion_step) written with plain torch ops, so they run on any device. The GPU
step uses them where its CUDA kernels do not reach: SGD, Adagrad, Lion and
Adam with amsgrad, and every optimizer when the kernels are unavailable.

Each function takes the C function's arguments and follows the scalar
reference (csrc/scalar.c, include/zero/optim_math.h) operation by operation: the
constants computed in double and rounded to float, then one torch op per
float operation. A fused op (lerp, addcmul, add with alpha) would be fewer
passes, but torch runs those as fused multiply-adds on the CPU and the GPU,
which moves results an ulp away from the reference; separate ops round
where the reference rounds, so the results equal the C scalar path's, but
for torch's CPU sqrt (MKL's vector sqrt: within an ulp, not correctly
rounded). The flat partition can be hundreds of millions of elements:
updates are in place, with at most two fp32 temporaries of its size.
"""
from __future__ import annotations

import math
import struct
from typing import Optional

import torch

from zero.step._hyperparameters import check_hyperparameters

__all__ = ["adam", "sgd", "adagrad", "lion"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _f32(x: float) -> float:
    """x rounded to float32, as the C core's (float) casts do."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # C's cast overflows to inf; struct refuses
        return math.copysign(math.inf, x)


# ---- argument checks (the C binding's, with the same messages; the
# hyperparameters' ranges are zero.optim's check_hyperparameters) ---------


def _finite(name, value) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _step(step) -> int:
    step = int(step)
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    return step


def _flat(buffers: dict, start: int, stop: int) -> dict:
    """Name -> the [start, stop) slice of that tensor, flat and detached;
    buffers maps each name to (tensor or None, whether it must be fp32).
    The first entry is the param, against which sizes and devices are
    checked; None entries stay None. Like the C binding, it checks every
    tensor given, used or not."""
    first = next(iter(buffers))
    param = buffers[first][0]
    spans = []
    flat = {}
    for name, (tensor, fp32_only) in buffers.items():
        if tensor is None:
            flat[name] = None
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        allowed = (torch.float32,) if fp32_only else _GRAD_DTYPES
        if tensor.dtype not in allowed:
            kinds = "float32" if fp32_only else "float32, bfloat16 or float16"
            raise ValueError(f"{name} must be {kinds}, got {tensor.dtype}")
        if tensor.numel() != param.numel():
            raise ValueError(f"{name} has {tensor.numel()} elements, {first} has "
                             f"{param.numel()}")
        if tensor.device != param.device:
            raise ValueError(f"{name} is on {tensor.device}, {first} on {param.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} is not contiguous; pass tensor.contiguous()")
        # Each op below writes one buffer while reading others: a shared
        # byte would be read after it is written.
        begin = tensor.data_ptr()
        end = begin + tensor.numel() * tensor.element_size()
        for other, (other_begin, other_end) in spans:
            if tensor.numel() and begin < other_end and other_begin < end:
                raise ValueError(f"{name} and {other} overlap in memory; each needs its "
                                 "own storage")
        spans.append((name, (begin, end)))
        flat[name] = tensor.detach().view(-1)
    n = param.numel()
    if stop < 0:
        stop = n
    if not 0 <= start <= stop <= n:
        raise ValueError(f"start={start}, stop={stop} is not a range within the {n} "
                         "elements")
    return {name: None if t is None else t[start:stop] for name, t in flat.items()}


# ---- the shared steps of the formulas -----------------------------------


def _scaled_grad(grad: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """grad in fp32 times grad_scale. The result may be grad itself, so
    callers only read it."""
    if grad.dtype == torch.float32:
        return grad if grad_scale == 1.0 else grad * grad_scale
    g = grad.float()
    return g if grad_scale == 1.0 else g.mul_(grad_scale)


def _add_l2(g: torch.Tensor, param: torch.Tensor, l2: float) -> torch.Tensor:
    """g + l2 * p. Skipped at l2 == 0, as the reference and torch.optim
    skip it (0 * inf would make an inf parameter NaN)."""
    if l2 == 0.0:
        return g
    return (param * l2).add_(g)  # addition commutes exactly


def _lerp_(out: torch.Tensor, start: torch.Tensor, end: torch.Tensor, weight: float,
           scratch: torch.Tensor) -> None:
    """out = lerp(start, end, weight) by optim_math.h's lerp, whose two forms
    are exact at either end; out may be start or scratch. Not torch.lerp:
    that one fuses the multiply-add (see the top of this file)."""
    torch.sub(end, start, out=scratch)
    if weight < 0.5:
        scratch.mul_(weight)
        torch.add(start, scratch, out=out)
    else:
        scratch.mul_(_f32(1.0 - weight))
        torch.sub(end, scratch, out=out)


def _divisor(value: float, like: torch.Tensor) -> torch.Tensor:
    # A plain number as divisor makes CUDA multiply by its reciprocal, an
    # ulp off the reference's division; a 0-dim tensor on the device does not.
    return torch.full((), value, dtype=torch.float32, device=like.device)


def _finish(param: torch.Tensor, copy_out: Optional[torch.Tensor]) -> None:
    if copy_out is not None:
        copy_out.copy_(param)  # round to nearest even, as the C core's store


# ---- the optimizers ------------------------------------------------------


def adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq=None, copy_out=None, *, lr,
         beta1, beta2, eps, weight_decay, step, decoupled=True, amsgrad=False,
         grad_scale=1.0, start=0, stop=-1) -> None:
    """One Adam (decoupled=False) or AdamW step over [start, stop) of flat
    tensors, in place, as zero._C.adam_step. grad may be float32, bfloat16
    or float16 and is multiplied by grad_scale; copy_out, when given,
    receives the updated parameters cast to its dtype."""
    lr, beta1, beta2, eps, weight_decay = check_hyperparameters(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    grad_scale = _finite("grad_scale", grad_scale)
    step = _step(step)
    decoupled, amsgrad = bool(decoupled), bool(amsgrad)
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("amsgrad=True needs the max_exp_avg_sq buffer")
    b = _flat({"param": (param, True), "grad": (grad, False), "exp_avg": (exp_avg, True),
               "exp_avg_sq": (exp_avg_sq, True),
               "max_exp_avg_sq": (max_exp_avg_sq, True), "copy_out": (copy_out, False)},
              int(start), int(stop))
    p, m, v = b["param"], b["exp_avg"], b["exp_avg_sq"]

    weight_factor = _f32(1.0 - lr * weight_decay) if decoupled else 1.0
    l2 = 0.0 if decoupled else _f32(weight_decay)
    step_size = _f32(lr / (1.0 - math.pow(beta1, step)))
    bias_correction2_sqrt = _f32(math.sqrt(1.0 - math.pow(beta2, step)))

    g = _add_l2(_scaled_grad(b["grad"], _f32(grad_scale)), p, l2)
    t = torch.empty_like(p)
    _lerp_(m, m, g, _f32(1.0 - beta1), t)
    # v * beta2 + (1 - beta2) * g * g, each product rounded in that order
    torch.mul(g, _f32(1.0 - beta2), out=t).mul_(g)
    v.mul_(_f32(beta2)).add_(t)
    del g
    root_of = v
    if amsgrad:
        # maximum: a NaN on either side gives NaN, as torch.optim's
        # amsgrad and the C core's max_keeping_nan
        torch.maximum(b["max_exp_avg_sq"], v, out=b["max_exp_avg_sq"])
        root_of = b["max_exp_avg_sq"]
    torch.sqrt(root_of, out=t).div_(_divisor(bias_correction2_sqrt, t)).add_(_f32(eps))
    torch.div(m, t, out=t).mul_(step_size)
    if weight_factor != 1.0:
        p.mul_(weight_factor)
    p.sub_(t)
    _finish(p, b["copy_out"])


def sgd(param, grad, momentum_buffer=None, copy_out=None, *, lr, momentum=0.0,
        dampening=0.0, weight_decay=0.0, nesterov=False, first_step=False, grad_scale=1.0,
        start=0, stop=-1) -> None:
    """One SGD step in place, as zero._C.sgd_step. With momentum,
    first_step=True starts the momentum buffer as the gradient, as
    torch.optim.SGD does."""
    lr, momentum, weight_decay = check_hyperparameters(lr=lr, momentum=momentum,
                                                       weight_decay=weight_decay)
    dampening = _finite("dampening", dampening)
    grad_scale = _finite("grad_scale", grad_scale)
    nesterov, first_step = bool(nesterov), bool(first_step)
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError("nesterov=True needs momentum > 0 and dampening 0")
    if momentum != 0.0 and momentum_buffer is None:
        raise ValueError("momentum != 0 needs the momentum_buffer")
    b = _flat({"param": (param, True), "grad": (grad, False),
               "momentum_buffer": (momentum_buffer, True), "copy_out": (copy_out, False)},
              int(start), int(stop))
    # Without momentum the C core checks a given buffer but leaves it alone.
    p, buf = b["param"], b["momentum_buffer"] if momentum != 0.0 else None

    g = _add_l2(_scaled_grad(b["grad"], _f32(grad_scale)), p, _f32(weight_decay))
    if buf is not None:
        mom = _f32(momentum)
        one_minus_dampening = _f32(1.0 - dampening)
        if first_step:
            buf.copy_(g)
        else:
            buf.mul_(mom)
            buf.add_(g if one_minus_dampening == 1.0 else g * one_minus_dampening)
        g = (buf * mom).add_(g) if nesterov else buf
    p.sub_(g * _f32(lr))
    _finish(p, b["copy_out"])


def adagrad(param, grad, state_sum, copy_out=None, *, lr, lr_decay=0.0, weight_decay=0.0,
            eps=1e-10, step, grad_scale=1.0, start=0, stop=-1) -> None:
    """One Adagrad step in place, as zero._C.adagrad_step and
    torch.optim.Adagrad; step is 1 on the first update."""
    lr, lr_decay, weight_decay, eps = check_hyperparameters(
        lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps)
    grad_scale = _finite("grad_scale", grad_scale)
    step = _step(step)
    b = _flat({"param": (param, True), "grad": (grad, False), "state_sum": (state_sum, True),
               "copy_out": (copy_out, False)}, int(start), int(stop))
    p, state = b["param"], b["state_sum"]

    step_size = _f32(lr / (1.0 + (step - 1) * lr_decay))
    g = _add_l2(_scaled_grad(b["grad"], _f32(grad_scale)), p, _f32(weight_decay))
    t = torch.mul(g, g)
    state.add_(t)
    torch.sqrt(state, out=t).add_(_f32(eps))
    torch.div(g, t, out=t).mul_(step_size)
    p.sub_(t)
    _finish(p, b["copy_out"])


def lion(param, grad, exp_avg, copy_out=None, *, lr, beta1, beta2, weight_decay=0.0,
         grad_scale=1.0, start=0, stop=-1) -> None:
    """One Lion step in place (Chen et al. 2023, decoupled weight decay), as
    zero._C.lion_step."""
    lr, beta1, beta2, weight_decay = check_hyperparameters(
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    grad_scale = _finite("grad_scale", grad_scale)
    b = _flat({"param": (param, True), "grad": (grad, False), "exp_avg": (exp_avg, True),
               "copy_out": (copy_out, False)}, int(start), int(stop))
    p, m = b["param"], b["exp_avg"]

    weight_factor = _f32(1.0 - lr * weight_decay)
    g = _scaled_grad(b["grad"], _f32(grad_scale))
    direction = torch.empty_like(p)
    _lerp_(direction, m, g, _f32(1.0 - beta1), direction)
    # torch's sign is the reference's (x > 0) - (x < 0) on the CPU and in
    # CUDA (c10::signum): 0 for nan, which leaves the parameter alone.
    direction.sign_().mul_(_f32(lr))
    if weight_factor != 1.0:
        p.mul_(weight_factor)
    p.sub_(direction)
    _lerp_(m, m, g, _f32(1.0 - beta2), direction)
    _finish(p, b["copy_out"])

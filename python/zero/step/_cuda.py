"""zero's CUDA kernels over torch tensors: thin calls into zero._C's cuda_*
functions that find the stream and allocate scratch memory.

Imported on demand (`from zero import _cuda`), never by `import zero`, and it
touches torch.cuda only once it holds a CUDA tensor. Each function launches
on torch's current stream of the tensors' device and returns without
waiting, like a torch op; see docs/cuda.md.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

import zero._C as _C

__all__ = ["available", "info", "adam_step", "multi_tensor_adam", "l2_norm", "unscale_",
           "pack", "unpack"]


def available() -> bool:
    """Whether the kernels can run here; info()["reason"] says why not."""
    return _C.cuda_available()


def info() -> dict:
    return _C.cuda_info()


def _stream_for(tensor: torch.Tensor, name: str) -> int:
    if tensor.device.type != "cuda":
        raise ValueError(f"{name} is on {tensor.device}; zero._cuda needs CUDA tensors "
                         "(the CPU step is zero.optim / zero._C.adam_step)")
    return torch.cuda.current_stream(tensor.device).cuda_stream


def _plain(tensor: Optional[torch.Tensor]):
    # What the binding takes: DLPack refuses tensors that require grad, and
    # the kernels write .data. (The emulated-driver tests replace this.)
    return None if tensor is None else tensor.detach()


def _plain_list(tensors):
    return None if tensors is None else [_plain(t) for t in tensors]


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, step: torch.Tensor, lr: float,
              betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
              decoupled: bool = True, grad_scale: float = 1.0,
              copy_out: Optional[torch.Tensor] = None,
              found_inf: Optional[torch.Tensor] = None) -> None:
    """One fused AdamW (decoupled=False: Adam) step over flat fp32 buffers.
    step is a 1-element float32 tensor the kernel advances; a nonzero
    found_inf skips the step on the device."""
    stream = _stream_for(param, "param")
    _C.cuda_adam_step(_plain(param), _plain(grad), _plain(exp_avg), _plain(exp_avg_sq),
                      _plain(copy_out), step=_plain(step), found_inf=_plain(found_inf),
                      lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                      weight_decay=weight_decay, decoupled=decoupled, grad_scale=grad_scale,
                      stream=stream)


def multi_tensor_adam(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                      *, step: torch.Tensor, lr: float, betas=(0.9, 0.999),
                      eps: float = 1e-8, weight_decay: float = 1e-2, decoupled: bool = True,
                      grad_scale: float = 1.0,
                      copy_outs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                      found_inf: Optional[torch.Tensor] = None) -> None:
    """adam_step over lists of tensors, many tensors per kernel launch."""
    stream = _stream_for(step, "step")
    _C.cuda_multi_tensor_adam(
        _plain_list(params), _plain_list(grads), _plain_list(exp_avgs),
        _plain_list(exp_avg_sqs), _plain_list(copy_outs), step=_plain(step),
        found_inf=_plain(found_inf), lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
        weight_decay=weight_decay, decoupled=decoupled, grad_scale=grad_scale, stream=stream)


def l2_norm(tensors: Sequence[torch.Tensor], *, squared: bool = False) -> torch.Tensor:
    """The L2 norm (or its square) of all elements, as a 0-dim float32 CUDA
    tensor; the same bits on every call for the same data."""
    if not tensors:
        raise ValueError("tensors is empty: the norm needs a device")
    stream = _stream_for(tensors[0], "tensors[0]")
    device = tensors[0].device
    partials = torch.empty(_C.cuda_norm_partials([t.numel() for t in tensors]),
                           dtype=torch.float32, device=device)
    out = torch.empty(1, dtype=torch.float32, device=device)
    _C.cuda_l2_norm(_plain_list(tensors), _plain(out), _plain(partials), squared=squared,
                    stream=stream)
    return out[0]


def unscale_(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, scale: float) -> None:
    """tensors *= scale in place; found_inf[0] = 1.0 where a result is inf or
    nan (it is never cleared: zero it before the first call of a step)."""
    stream = _stream_for(found_inf, "found_inf")
    _C.cuda_unscale_check(_plain_list(tensors), _plain(found_inf), scale=scale, stream=stream)


def pack(tensors: Sequence[torch.Tensor], bucket: torch.Tensor,
         offsets: Optional[Sequence[int]] = None, scale: float = 1.0) -> None:
    """bucket[offsets[i]:][:numel] = tensors[i] * scale, cast to the bucket's
    dtype (offsets None: back to back)."""
    stream = _stream_for(bucket, "bucket")
    _C.cuda_pack(_plain_list(tensors), _plain(bucket), offsets=offsets, scale=scale,
                 stream=stream)


def unpack(bucket: torch.Tensor, tensors: Sequence[torch.Tensor],
           offsets: Optional[Sequence[int]] = None) -> None:
    """tensors[i] = bucket[offsets[i]:][:numel], cast to each tensor's dtype."""
    stream = _stream_for(bucket, "bucket")
    _C.cuda_unpack(_plain(bucket), _plain_list(tensors), offsets=offsets, stream=stream)

"""An example kernel plugin: RMSNorm as one custom op with a hand-written backward.

Importing this module registers implementation `example_rms_norm` of titanite's `rms_norm` op.
It is written the way titanite's own kernels are: a `torch.library` custom op (so torch.compile
and FSDP treat it as one opaque op) with a fake implementation (shapes and dtypes for tracing)
and an autograd registration whose backward is a second custom op. The math here is plain
PyTorch so that it runs on every device; a real plugin would launch its own Triton or CUDA
kernel inside the two ops instead.

Check it against the reference, forward and backward, with
    titanite kernels verify rms_norm --impl example_rms_norm --plugins titanite_example_kernels
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import titanite


@torch.library.custom_op("titanite_example::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x: [..., D] -> (y like the reference, 1/rms fp32 [..., 1] kept for the backward)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd


@_rms_norm.register_fake
def _(x, weight, eps):
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    return y, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("titanite_example::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    xhat = x.float() * rstd
    dw = (dy * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).float().sum(0).to(weight.dtype)
    g = dy.float() * weight.float()
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.titanite_example.rms_norm_backward(dy, x, weight, rstd)
    return dx, dw, None


_rms_norm.register_autograd(_backward, setup_context=_setup)


@titanite.kernels.register("rms_norm", "example_rms_norm",
                           dtypes=(torch.float32, torch.bfloat16, torch.float16))
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The op's signature exactly: (x, weight, eps) -> y. titanite checks it at registration."""
    assert math.isfinite(eps) and eps > 0, eps
    return torch.ops.titanite_example.rms_norm(x, weight, float(eps))[0]

"""The Triton kernels as `torch.library` custom ops (fake + autograd), registered as `triton`.

Each forward op returns what its backward needs (e.g. RMSNorm's per-row 1/rms, the MoE
gate/up pre-activations); the public wrappers return only the op's result. The kernel modules
are imported inside the ops, so defining the ops needs no Triton.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from titanite.kernels.registry import register
from titanite.kernels.torch_impls import compute_dtype
from titanite.kernels.triton.availability import COMPILED_ON, INTERPRETED_ON, unavailable, unavailable_dot

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_DEVICES = COMPILED_ON + INTERPRETED_ON  # interpreted: only under TRITON_INTERPRET=1 (see `unavailable`)


# -- RMSNorm ----------------------------------------------------------------------------------

@torch.library.custom_op("titanite::rms_norm_triton", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    import titanite.kernels.triton.norm_act as norm_act

    D = x.shape[-1]
    y, rstd = norm_act.rms_norm_fwd(x.reshape(-1, D).contiguous(), weight.contiguous(), eps,
                                    torch.promote_types(x.dtype, weight.dtype))
    return y.view(x.shape), rstd


@_rms_norm.register_fake
def _(x, weight, eps):
    rows = math.prod(x.shape[:-1])
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("titanite::rms_norm_triton_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    import titanite.kernels.triton.norm_act as norm_act

    D = x.shape[-1]
    dx, dw = norm_act.rms_norm_bwd(dy.reshape(-1, D).contiguous(), x.reshape(-1, D).contiguous(),
                                   weight.contiguous(), rstd)
    return dx.view(x.shape), dw


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_bwd(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.titanite.rms_norm_triton_backward(dy, x, weight, rstd)
    return dx, dw, None


_rms_norm.register_autograd(_rms_norm_bwd, setup_context=_rms_norm_setup)


@register("rms_norm", "triton", devices=_DEVICES, dtypes=_FLOATS, requires=unavailable)
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Fused RMSNorm (one read and one write of x); semantics of the reference."""
    return torch.ops.titanite.rms_norm_triton(x, weight, float(eps))[0]


# -- SwiGLU -----------------------------------------------------------------------------------

@torch.library.custom_op("titanite::swiglu_triton", mutates_args=())
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    import titanite.kernels.triton.norm_act as norm_act

    return norm_act.swiglu_fwd(gate.contiguous(), up.contiguous())


@_swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("titanite::swiglu_triton_backward", mutates_args=())
def _swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    import titanite.kernels.triton.norm_act as norm_act

    return norm_act.swiglu_bwd(dy.contiguous(), gate.contiguous(), up.contiguous())


@_swiglu_backward.register_fake
def _(dy, gate, up):
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_bwd(ctx, dy):
    gate, up = ctx.saved_tensors
    return torch.ops.titanite.swiglu_triton_backward(dy, gate, up)


_swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


@register("swiglu", "triton", devices=_DEVICES, dtypes=_FLOATS, requires=unavailable)
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """Fused silu(gate) * up, with a fused backward (no silu intermediate kept)."""
    assert gate.shape == up.shape, f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ"
    dtype = compute_dtype(gate, up)
    return torch.ops.titanite.swiglu_triton(gate.to(dtype), up.to(dtype))


# -- MoE experts: grouped-GEMM SwiGLU MLP -----------------------------------------------------

@torch.library.custom_op("titanite::moe_experts_triton", mutates_args=())
def _experts(x: Tensor, offsets: Tensor, w_gate_up: Tensor, w_down: Tensor, keep_gu: bool) -> tuple[Tensor, Tensor]:
    import titanite.kernels.triton.grouped_gemm as grouped_gemm

    return grouped_gemm.experts_fwd(x.contiguous(), offsets, w_gate_up, w_down, keep_gu)


@_experts.register_fake
def _(x, offsets, w_gate_up, w_down, keep_gu):
    gu_shape = (x.shape[0], w_gate_up.shape[1]) if keep_gu else (0,)
    return x.new_empty(x.shape), x.new_empty(gu_shape)


@torch.library.custom_op("titanite::moe_experts_triton_backward", mutates_args=())
def _experts_backward(dy: Tensor, x: Tensor, offsets: Tensor, w_gate_up: Tensor, w_down: Tensor,
                      gu: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    import titanite.kernels.triton.grouped_gemm as grouped_gemm

    return grouped_gemm.experts_bwd(dy.contiguous(), x.contiguous(), offsets, w_gate_up, w_down, gu)


@_experts_backward.register_fake
def _(dy, x, offsets, w_gate_up, w_down, gu):
    return x.new_empty(x.shape), w_gate_up.new_empty(w_gate_up.shape), w_down.new_empty(w_down.shape)


def _experts_setup(ctx, inputs, output):
    x, offsets, w_gate_up, w_down, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, offsets, w_gate_up, w_down, output[1])


def _experts_bwd(ctx, dy, _dgu):
    x, offsets, w_gate_up, w_down, gu = ctx.saved_tensors
    dx, dw_gate_up, dw_down = torch.ops.titanite.moe_experts_triton_backward(dy, x, offsets, w_gate_up, w_down, gu)
    return dx, None, dw_gate_up, dw_down, None


_experts.register_autograd(_experts_bwd, setup_context=_experts_setup)


@register("moe.experts", "triton", devices=_DEVICES, dtypes=_FLOATS, requires=unavailable_dot)
def moe_experts(x: Tensor, counts: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """Grouped-GEMM SwiGLU MLP: gate/up GEMM with the SwiGLU fused in its epilogue, then down."""
    dtype = compute_dtype(x, w_gate_up, w_down)
    xc, wgu, wd = x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)
    offsets = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    keep_gu = torch.is_grad_enabled() and any(t.requires_grad for t in (xc, wgu, wd))
    y, _ = torch.ops.titanite.moe_experts_triton(xc, offsets, wgu, wd, keep_gu)
    return y.to(x.dtype)

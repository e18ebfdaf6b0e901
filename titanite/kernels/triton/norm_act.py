"""Triton kernels for RMSNorm and SwiGLU, forward and backward. All math in fp32.

Launchers take contiguous 2-D / 1-D tensors and return new tensors; the custom ops in
`triton/ops.py` reshape, save for backward and register autograd around them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ELEMS_PER_PROGRAM = 4096  # rows x columns one program handles: enough work per program
_MAX_BWD_PROGRAMS = 512  # RMSNorm backward: programs each accumulating a weight-grad partial
_SWIGLU_BLOCK = 1024


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, R, D, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    mask = rmask[:, None] & (cols < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    # As the reference: normalise in fp32, round to x's dtype, then scale by the weight.
    xhat = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(Y + offs, (xhat * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, DW_PART, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_R
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(pid * BLOCK_R, R, step):
        rows = start + tl.arange(0, BLOCK_R)
        rmask = rows < R
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * D + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        dw += tl.sum(dy * xhat.to(X.dtype.element_ty).to(tl.float32), axis=0)
        g = dy * w[None, :]
        dot = tl.sum(g * xhat, axis=1) / D
        dx = (g - xhat * dot[:, None]) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * D + cols, dw, mask=cmask)


def _row_blocks(R: int, D: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(_ELEMS_PER_PROGRAM // block_d, triton.next_power_of_2(max(R, 1))))
    return block_r, block_d


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, D] contiguous; weight: [D]. Returns (y [R, D] out_dtype, rstd fp32 [R])."""
    R, D = x.shape
    y = torch.empty((R, D), dtype=out_dtype, device=x.device)
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        block_r, block_d = _row_blocks(R, D)
        _rms_norm_fwd[(triton.cdiv(R, block_r),)](x, weight, y, rstd, R, D, eps, BLOCK_R=block_r, BLOCK_D=block_d)
    return y, rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x: [R, D] contiguous. Returns (dx [R, D] x.dtype, dweight [D] weight.dtype)."""
    R, D = x.shape
    dx = torch.empty_like(x)
    if R == 0:
        return dx, torch.zeros_like(weight)
    block_r, block_d = _row_blocks(R, D)
    programs = min(triton.cdiv(R, block_r), _MAX_BWD_PROGRAMS)
    dw_part = torch.empty((programs, D), dtype=torch.float32, device=x.device)
    _rms_norm_bwd[(programs,)](dy, x, weight, rstd, dx, dw_part, R, D, BLOCK_R=block_r, BLOCK_D=block_d)
    return dx, dw_part.sum(0).to(weight.dtype)


@triton.jit
def _swiglu_fwd(G, U, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, G, U, DG, DU, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DU + offs, (dy * g * s).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: contiguous, same shape and dtype. Returns silu(gate) * up."""
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd[(triton.cdiv(n, _SWIGLU_BLOCK),)](gate, up, y, n, BLOCK=_SWIGLU_BLOCK)
    return y


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dgate, dup), each like gate."""
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _swiglu_bwd[(triton.cdiv(n, _SWIGLU_BLOCK),)](dy, gate, up, dg, du, n, BLOCK=_SWIGLU_BLOCK)
    return dg, du

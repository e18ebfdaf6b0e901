"""Triton grouped GEMMs for the MoE SwiGLU MLP, forward and backward.

Rows (tokens) arrive grouped by expert; `offsets` (int32 [E+1]) bounds each expert's rows.
Row-grouped kernels cut each expert's rows into BLOCK_M tiles; a program finds its tile's
expert by scanning the offsets, so the grid needs no host sync: at most cdiv(T, BLOCK_M) + E
tiles exist, and surplus programs exit. Weight-gradient kernels give each expert its own
programs and reduce over that expert's rows; an expert with no rows gets zero gradients.

Forward:  gu = x @ Wgu[e]^T (kept for backward), act = silu(gate) * up   (one fused kernel)
          y = act @ Wd[e]^T
Backward: dact = dy @ Wd[e], dgu = SwiGLU'(gu) * dact                    (one fused kernel)
          dWd[e] = dy^T @ act (act recomputed from gu on load), dWgu[e] = dgu^T @ x, dx = dgu @ Wgu[e]
Accumulation is fp32; fp32 inputs use IEEE fp32 dot products (no TF32), like torch's default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titanite.kernels.triton.availability import interpreting

# The interpreter cannot autotune; small fixed tiles keep it quick and exercise edge tiles.
_INTERPRETER_TILES = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}
_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s in [(64, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3),
                             (128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4)]
]


@triton.jit
def _find_tile(OFFS, E, tile, BLOCK_M: tl.constexpr):
    """The expert owning row tile `tile`, its first row and its expert's end row; expert -1 = none."""
    expert = -1
    start = 0
    end = 0
    seen = 0
    for e in range(E):
        lo = tl.load(OFFS + e)
        hi = tl.load(OFFS + e + 1)
        n = tl.cdiv(hi - lo, BLOCK_M)
        hit = (tile >= seen) & (tile < seen + n)
        expert = tl.where(hit, e, expert)
        start = tl.where(hit, lo + (tile - seen) * BLOCK_M, start)
        end = tl.where(hit, hi, end)
        seen += n
    return expert, start, end


@triton.jit
def _gate_up_swiglu(X, W, OFFS, GU, ACT, E, H, I, s_we, s_wn, s_wk, PREC: tl.constexpr, STORE_GU: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """GU[r] = X[r] @ W[e]^T ([T, 2I], gate then up); ACT[r] = silu(gate) * up ([T, I])."""
    expert, start, end = _find_tile(OFFS, E, tl.program_id(0), BLOCK_M)
    if expert >= 0:
        rows = start + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, cmask = rows < end, cols < I
        w_base = W + expert.to(tl.int64) * s_we
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < H
            x = tl.load(X + rows[:, None].to(tl.int64) * H + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & cmask[None, :]
            wg = tl.load(w_base + cols[None, :] * s_wn + ks[:, None] * s_wk, mask=wmask, other=0.0)
            wu = tl.load(w_base + (cols[None, :] + I) * s_wn + ks[:, None] * s_wk, mask=wmask, other=0.0)
            acc_g = tl.dot(x, wg, acc_g, input_precision=PREC)
            acc_u = tl.dot(x, wu, acc_u, input_precision=PREC)
        dtype = ACT.dtype.element_ty
        g = acc_g.to(dtype)
        u = acc_u.to(dtype)
        mask = rmask[:, None] & cmask[None, :]
        row_off = rows[:, None].to(tl.int64)
        if STORE_GU:
            tl.store(GU + row_off * (2 * I) + cols[None, :], g, mask=mask)
            tl.store(GU + row_off * (2 * I) + I + cols[None, :], u, mask=mask)
        gf = g.to(tl.float32)
        act = gf * tl.sigmoid(gf) * u.to(tl.float32)
        tl.store(ACT + row_off * I + cols[None, :], act.to(dtype), mask=mask)


@triton.jit
def _grouped_mm(A, B, OFFS, C, GU, E, N, K, s_be, s_bk, s_bn, PREC: tl.constexpr, SWIGLU_BWD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[r, n] = sum_k A[r, k] B[e, k, n] (B by strides). A: [T, K], C: [T, N] contiguous.

    With SWIGLU_BWD, the product is dact and C receives dgu [T, 2N]: the SwiGLU derivative
    at GU ([T, 2N], gate then up) times dact.
    """
    expert, start, end = _find_tile(OFFS, E, tl.program_id(0), BLOCK_M)
    if expert >= 0:
        rows = start + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, cmask = rows < end, cols < N
        b_base = B + expert.to(tl.int64) * s_be
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            a = tl.load(A + rows[:, None].to(tl.int64) * K + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_base + ks[:, None] * s_bk + cols[None, :] * s_bn, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        mask = rmask[:, None] & cmask[None, :]
        row_off = rows[:, None].to(tl.int64)
        dtype = C.dtype.element_ty
        if SWIGLU_BWD:
            dact = acc.to(dtype).to(tl.float32)
            g = tl.load(GU + row_off * (2 * N) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            u = tl.load(GU + row_off * (2 * N) + N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = tl.sigmoid(g)
            tl.store(C + row_off * (2 * N) + cols[None, :], (dact * u * s * (1.0 + g * (1.0 - s))).to(dtype), mask=mask)
            tl.store(C + row_off * (2 * N) + N + cols[None, :], (dact * g * s).to(dtype), mask=mask)
        else:
            tl.store(C + row_off * N + cols[None, :], acc.to(dtype), mask=mask)


@triton.jit
def _grouped_wgrad(DY, X, OFFS, DW, N, K, PREC: tl.constexpr, X_FROM_GU: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """DW[e, n, k] = sum over expert e's rows r of DY[r, n] X[r, k]. DY: [T, N], DW: [E, N, K].

    With X_FROM_GU, X is GU [T, 2K] and the rows used are silu(gate) * up (recomputed, not stored).
    """
    expert = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    ns = (tl.program_id(1) // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (tl.program_id(1) % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    nmask, kmask = ns < N, ks < K
    lo = tl.load(OFFS + expert)
    hi = tl.load(OFFS + expert + 1)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < hi
        row_off = rows.to(tl.int64)
        dy = tl.load(DY + row_off[None, :] * N + ns[:, None], mask=rmask[None, :] & nmask[:, None], other=0.0)
        xmask = rmask[:, None] & kmask[None, :]
        if X_FROM_GU:
            g = tl.load(X + row_off[:, None] * (2 * K) + ks[None, :], mask=xmask, other=0.0).to(tl.float32)
            u = tl.load(X + row_off[:, None] * (2 * K) + K + ks[None, :], mask=xmask, other=0.0).to(tl.float32)
            x = (g * tl.sigmoid(g) * u).to(DY.dtype.element_ty)
        else:
            x = tl.load(X + row_off[:, None] * K + ks[None, :], mask=xmask, other=0.0)
        acc = tl.dot(dy, x, acc, input_precision=PREC)
    out = DW + expert.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :]
    tl.store(out, acc.to(DW.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


def _tuned(kernel, key: list[str]):
    return kernel if interpreting() else triton.autotune(configs=_GPU_CONFIGS, key=key)(kernel)


_gate_up_swiglu_k = _tuned(_gate_up_swiglu, ["H", "I"])
_grouped_mm_k = _tuned(_grouped_mm, ["N", "K"])
_grouped_wgrad_k = _tuned(_grouped_wgrad, ["N", "K"])
_TILES = _INTERPRETER_TILES if interpreting() else {}


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _row_grid(T: int, E: int, n_cols: int):
    return lambda meta: (triton.cdiv(T, meta["BLOCK_M"]) + E, triton.cdiv(n_cols, meta["BLOCK_N"]))


def _weight_grid(E: int, N: int, K: int):
    return lambda meta: (E, triton.cdiv(N, meta["BLOCK_N"]) * triton.cdiv(K, meta["BLOCK_K"]))


def experts_fwd(x: torch.Tensor, offsets: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                keep_gu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] contiguous, offsets int32 [E+1], w_gate_up [E, 2I, H], w_down [E, H, I], one dtype.

    Returns (y [T, H], gu [T, 2I] when keep_gu else an empty tensor).
    """
    T, H = x.shape
    E, I = w_down.shape[0], w_down.shape[2]
    act = torch.empty((T, I), dtype=x.dtype, device=x.device)
    gu = torch.empty((T, 2 * I) if keep_gu else (0,), dtype=x.dtype, device=x.device)
    y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return y, gu
    prec = _prec(x.dtype)
    _gate_up_swiglu_k[_row_grid(T, E, I)](x, w_gate_up, offsets, gu, act, E, H, I, *w_gate_up.stride(),
                                          PREC=prec, STORE_GU=keep_gu, **_TILES)
    _grouped_mm_k[_row_grid(T, E, H)](act, w_down, offsets, y, y, E, H, I,
                                      w_down.stride(0), w_down.stride(2), w_down.stride(1),
                                      PREC=prec, SWIGLU_BWD=False, **_TILES)
    return y, gu


def experts_bwd(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dx [T, H], dw_gate_up [E, 2I, H], dw_down [E, H, I]) from dy [T, H]."""
    T, H = x.shape
    E, I = w_down.shape[0], w_down.shape[2]
    prec = _prec(x.dtype)
    dgu = torch.empty((T, 2 * I), dtype=x.dtype, device=x.device)
    dx = torch.empty_like(x)
    # Kernels write these as contiguous [E, N, K], whatever the weights' strides.
    dw_down = torch.empty(w_down.shape, dtype=w_down.dtype, device=x.device)
    dw_gate_up = torch.empty(w_gate_up.shape, dtype=w_gate_up.dtype, device=x.device)
    if T:
        _grouped_mm_k[_row_grid(T, E, I)](dy, w_down, offsets, dgu, gu, E, I, H,
                                          w_down.stride(0), w_down.stride(1), w_down.stride(2),
                                          PREC=prec, SWIGLU_BWD=True, **_TILES)
        _grouped_mm_k[_row_grid(T, E, H)](dgu, w_gate_up, offsets, dx, dx, E, H, 2 * I,
                                          w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2),
                                          PREC=prec, SWIGLU_BWD=False, **_TILES)
    _grouped_wgrad_k[_weight_grid(E, H, I)](dy, gu, offsets, dw_down, H, I, PREC=prec, X_FROM_GU=True, **_TILES)
    _grouped_wgrad_k[_weight_grid(E, 2 * I, H)](dgu, x, offsets, dw_gate_up, 2 * I, H, PREC=prec,
                                                X_FROM_GU=False, **_TILES)
    return dx, dw_gate_up, dw_down

"""Triton kernels for the chunked gated delta rule (Gated DeltaNet), forward and backward.

One program per (batch row, value head) scans the row's chunks of BT tokens, the state
[Dk, Dv] (fp32) in registers. Per chunk, with gamma the cumulative log decay inside the chunk,
Gam[i, j] = exp(gamma_i - gamma_j) for j <= i in the same document (else 0), alpha_t = exp(gamma_t)
while t is still in the chunk's first document (else 0: a restart zeroes the incoming state),
omega_t = exp(gamma_last - gamma_t) while t is in the chunk's last document, lam = exp(gamma_last)
when the chunk has no restart:
    A  = strict_lower((beta k) k^T * Gam);  T = (I + A)^-1          (the UT transform)
    U  = T (beta v);  W = T (beta alpha k);  V' = U - W S0            (the delta rule's writes)
    O  = scale (alpha q) S0 + (scale q k^T * Gam) V'
    S1 = lam S0 + (omega k)^T V'
Document restarts are a per-token reset flag (1 where a document starts, except at t = 0 where
the row starts from its initial state), turned into in-chunk segment numbers by a cumsum, so
packed documents need no host sync. The backward re-runs the forward scan to store each chunk's
incoming state, then scans the chunks in reverse carrying dS, the gradient of the state.

All math is fp32 (inputs of any float dtype are upcast on load), dot products in tf32x3 when
compiled (IEEE fp32 in the interpreter): the triangular inverse and the chained chunk products
would amplify plain TF32's rounding. dq and dk are written per value head and value block; the
caller sums them (a key head's gradient is its value heads' sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titanite.kernels.triton.availability import interpreting

BT = 64  # chunk size: as the reference, transformers and fla-core


@triton.jit
def _chunk_terms(K, V, G, BETA, RESET, b, h, hk, c, v0, S, Hk, Hv, Dk, Dv, PREC: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Load chunk c of (b, h) and build what forward and backward share (see the module doc).

    Returns k [BT, BK], v [BT, BV] (columns v0 + [0, BV)), beta [BT], gam [BT] (cumulative log decay), Gam [BT, BT],
    alpha [BT], omega [BT], lam (scalar), kk = k k^T [BT, BT], T = (I + A)^-1 [BT, BT], the token
    positions [BT], their mask and the flat row index b * S + t [BT] (int64)."""
    rows = tl.arange(0, BT)
    t = c * BT + rows
    tmask = t < S
    flat = b.to(tl.int64) * S + t
    dk = tl.arange(0, BK)
    dv = v0 + tl.arange(0, BV)
    kmask = tmask[:, None] & (dk < Dk)[None, :]
    vmask = tmask[:, None] & (dv < Dv)[None, :]
    # Past the row's end: k = v = beta = 0 and g = 0, so those tokens write nothing and decay nothing.
    k = tl.load(K + (flat[:, None] * Hk + hk) * Dk + dk[None, :], mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(V + (flat[:, None] * Hv + h) * Dv + dv[None, :], mask=vmask, other=0.0).to(tl.float32)
    g = tl.load(G + flat * Hv + h, mask=tmask, other=0.0).to(tl.float32)
    beta = tl.load(BETA + flat * Hv + h, mask=tmask, other=0.0).to(tl.float32)
    reset = tl.load(RESET + flat, mask=tmask, other=0)
    gam = tl.cumsum(g, 0)
    seg = tl.cumsum(reset, 0)  # document number inside the chunk; 0 = the incoming state's document
    is_last = rows == BT - 1
    gam_last = tl.sum(tl.where(is_last, gam, 0.0), 0)
    seg_last = tl.sum(tl.where(is_last, seg, 0), 0)
    linked = (rows[:, None] >= rows[None, :]) & (seg[:, None] == seg[None, :])
    # Masked before exp: above the diagonal gamma_i - gamma_j > 0 could overflow.
    Gam = tl.where(linked, tl.exp(tl.where(linked, gam[:, None] - gam[None, :], 0.0)), 0.0)
    alpha = tl.where(seg == 0, tl.exp(gam), 0.0)
    omega = tl.where(seg == seg_last, tl.exp(gam_last - gam), 0.0)
    lam = tl.where(seg_last == 0, tl.exp(gam_last), 0.0)
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)
    A = tl.where(rows[:, None] > rows[None, :], beta[:, None] * kk * Gam, 0.0)
    # T = (I + A)^-1 by forward substitution, one row at a time: row i = e_i - sum_j<i A_ij T_j.
    # (Stable where a doubling (I - A)(I + A^2)(I + A^4)... is not: repeated keys make A's powers huge.)
    T = tl.zeros([BT, BT], dtype=tl.float32)
    for i in range(BT):
        a_i = tl.sum(tl.where(rows[:, None] == i, A, 0.0), 0)  # row i of A, [BT] over j
        t_i = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * T, 0)
        T = tl.where(rows[:, None] == i, t_i[None, :], T)
    return k, v, beta, gam, Gam, alpha, omega, lam, kk, T, tmask, flat


@triton.jit
def _fwd(Q, K, V, G, BETA, RESET, H0, O, HT, STATES, S, Hk, Hv, Dk, Dv, scale, NT,
         WRITE_O: tl.constexpr, STORE_STATES: tl.constexpr, PREC: tl.constexpr,
         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Program (b, h, value block): O [B, S, Hv, Dv] and HT [B, Hv, Dk, Dv] (the state after the
    row's last token), the block's columns; with STORE_STATES, STATES [B, Hv, NT, Dk, Dv] receives
    each chunk's incoming state."""
    pid = tl.program_id(0)
    b = pid // Hv
    h = pid % Hv
    hk = h // (Hv // Hk)
    v0 = tl.program_id(1) * BV
    dk = tl.arange(0, BK)
    dv = v0 + tl.arange(0, BV)
    smask = (dk < Dk)[:, None] & (dv < Dv)[None, :]
    soffs = dk[:, None] * Dv + dv[None, :]
    state = tl.load(H0 + pid.to(tl.int64) * Dk * Dv + soffs, mask=smask, other=0.0)
    for c in range(NT):
        if STORE_STATES:
            tl.store(STATES + (pid.to(tl.int64) * NT + c) * Dk * Dv + soffs, state, mask=smask)
        k, v, beta, gam, Gam, alpha, omega, lam, kk, T, tmask, flat = _chunk_terms(
            K, V, G, BETA, RESET, b, h, hk, c, v0, S, Hk, Hv, Dk, Dv, PREC, BT, BK, BV)
        U = tl.dot(T, beta[:, None] * v, input_precision=PREC)
        W = tl.dot(T, (beta * alpha)[:, None] * k, input_precision=PREC)
        vnew = U - tl.dot(W, state, input_precision=PREC)
        if WRITE_O:
            qmask = tmask[:, None] & (dk < Dk)[None, :]
            q = tl.load(Q + (flat[:, None] * Hk + hk) * Dk + dk[None, :], mask=qmask, other=0.0).to(tl.float32)
            q = q * scale
            P = tl.dot(q, tl.trans(k), input_precision=PREC) * Gam
            o = tl.dot(alpha[:, None] * q, state, input_precision=PREC) + tl.dot(P, vnew, input_precision=PREC)
            omask = tmask[:, None] & (dv < Dv)[None, :]
            tl.store(O + (flat[:, None] * Hv + h) * Dv + dv[None, :], o.to(O.dtype.element_ty), mask=omask)
        state = lam * state + tl.dot(tl.trans(omega[:, None] * k), vnew, input_precision=PREC)
    tl.store(HT + pid.to(tl.int64) * Dk * Dv + soffs, state, mask=smask)


@triton.jit
def _bwd(Q, K, V, G, BETA, RESET, STATES, DO, DHT, DQ, DK, DV, DG, DBETA, DH0,
         S, Hk, Hv, Dk, Dv, scale, NT, PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Program (b, h, value block), chunks in reverse: DV [B, S, Hv, Dv] and DH0 [B, Hv, Dk, Dv]
    (its columns), and its value block's share of DQ, DK [NV, B, S, Hv, Dk] (per value head),
    DG, DBETA [NV, B, S, Hv]; all fp32, from DO [B, S, Hv, Dv] and DHT [B, Hv, Dk, Dv]."""
    pid = tl.program_id(0)
    b = pid // Hv
    h = pid % Hv
    hk = h // (Hv // Hk)
    v0 = tl.program_id(1) * BV
    part = tl.program_id(1).to(tl.int64) * (tl.num_programs(0) // Hv) * S * Hv  # this block's partial sums
    rows = tl.arange(0, BT)
    dk = tl.arange(0, BK)
    dv = v0 + tl.arange(0, BV)
    smask = (dk < Dk)[:, None] & (dv < Dv)[None, :]
    soffs = dk[:, None] * Dv + dv[None, :]
    dstate = tl.load(DHT + pid.to(tl.int64) * Dk * Dv + soffs, mask=smask, other=0.0).to(tl.float32)
    for ci in range(NT):
        c = NT - 1 - ci
        k, v, beta, gam, Gam, alpha, omega, lam, kk, T, tmask, flat = _chunk_terms(
            K, V, G, BETA, RESET, b, h, hk, c, v0, S, Hk, Hv, Dk, Dv, PREC, BT, BK, BV)
        s0 = tl.load(STATES + (pid.to(tl.int64) * NT + c) * Dk * Dv + soffs, mask=smask, other=0.0)
        kmask = tmask[:, None] & (dk < Dk)[None, :]
        vmask = tmask[:, None] & (dv < Dv)[None, :]
        q = tl.load(Q + (flat[:, None] * Hk + hk) * Dk + dk[None, :], mask=kmask, other=0.0).to(tl.float32) * scale
        do = tl.load(DO + (flat[:, None] * Hv + h) * Dv + dv[None, :], mask=vmask, other=0.0).to(tl.float32)
        U = tl.dot(T, beta[:, None] * v, input_precision=PREC)
        W = tl.dot(T, (beta * alpha)[:, None] * k, input_precision=PREC)
        vnew = U - tl.dot(W, s0, input_precision=PREC)
        QK = tl.dot(q, tl.trans(k), input_precision=PREC)
        P = QK * Gam
        # Through O = (alpha q) S0 + P V' and S1 = lam S0 + (omega k)^T V'.
        dvnew = tl.dot(tl.trans(P), do, input_precision=PREC) + \
            tl.dot(omega[:, None] * k, dstate, input_precision=PREC)
        dqa = tl.dot(do, tl.trans(s0), input_precision=PREC)  # d(alpha q)
        dPG = tl.dot(do, tl.trans(vnew), input_precision=PREC) * Gam
        dq = alpha[:, None] * dqa + tl.dot(dPG, k, input_precision=PREC)
        dkk = tl.dot(tl.trans(dPG), q, input_precision=PREC)
        dalpha = tl.sum(dqa * q, 1)
        dwk = tl.dot(vnew, tl.trans(dstate), input_precision=PREC)  # d(omega k)
        dkk += omega[:, None] * dwk
        domega = tl.sum(dwk * k, 1)
        dlam = tl.sum(tl.sum(s0 * dstate, 1), 0)
        # The state's gradient for the previous chunk, before V' = U - W S0 adds its share.
        dstate_prev = tl.dot(tl.trans(alpha[:, None] * q), do, input_precision=PREC) + lam * dstate - \
            tl.dot(tl.trans(W), dvnew, input_precision=PREC)
        # Through U = T (beta v), W = T (beta alpha k), T = (I + A)^-1: dX = T^T dY, dA = -dX Y^T.
        dW = -tl.dot(dvnew, tl.trans(s0), input_precision=PREC)
        dxv = tl.dot(tl.trans(T), dvnew, input_precision=PREC)
        dxk = tl.dot(tl.trans(T), dW, input_precision=PREC)
        dA = -(tl.dot(dxv, tl.trans(U), input_precision=PREC) + tl.dot(dxk, tl.trans(W), input_precision=PREC))
        dAG = tl.where(rows[:, None] > rows[None, :], dA, 0.0) * Gam
        kxk = tl.sum(k * dxk, 1)
        dvv = beta[:, None] * dxv
        dbeta = tl.sum(v * dxv, 1) + alpha * kxk + tl.sum(dAG * kk, 1)
        dalpha += beta * kxk
        dkk += (beta * alpha)[:, None] * dxk
        # Through A = strict_lower(beta_i Gam_ij k_i . k_j).
        dkk += beta[:, None] * tl.dot(dAG, k, input_precision=PREC) + \
            tl.dot(tl.trans(dAG), beta[:, None] * k, input_precision=PREC)
        # The decays all depend on gam = cumsum(g): dGam_ij Gam_ij adds to gam_i, subtracts from gam_j.
        M = dPG * QK + dAG * beta[:, None] * kk
        dgam = tl.sum(M, 1) - tl.sum(M, 0) + dalpha * alpha - domega * omega
        dgam += tl.where(rows == BT - 1, tl.sum(domega * omega, 0) + dlam * lam, 0.0)
        dg = tl.sum(dgam, 0) - tl.cumsum(dgam, 0) + dgam  # dg_t = sum over s >= t of dgam_s
        tl.store(DQ + (part + flat[:, None] * Hv + h) * Dk + dk[None, :], dq * scale, mask=kmask)
        tl.store(DK + (part + flat[:, None] * Hv + h) * Dk + dk[None, :], dkk, mask=kmask)
        tl.store(DV + (flat[:, None] * Hv + h) * Dv + dv[None, :], dvv, mask=vmask)
        tl.store(DG + part + flat * Hv + h, dg, mask=tmask)
        tl.store(DBETA + part + flat * Hv + h, dbeta, mask=tmask)
        dstate = dstate_prev
    tl.store(DH0 + pid.to(tl.int64) * Dk * Dv + soffs, dstate, mask=smask)


def _blocks(Dk: int, Dv: int) -> dict:
    """Tile sizes: tl.dot needs every dimension >= 16. Compiled, the value dim is cut into blocks
    of BV columns, one program each (the state's columns evolve independently; the UT inverse is
    recomputed per block), to bound registers and shared memory: at Dk = 128 the backward needs
    about 224 KiB of shared memory with BV = 16 on sm_90. The interpreter takes all columns at once."""
    BK = max(16, triton.next_power_of_2(Dk))
    BV = max(16, triton.next_power_of_2(Dv))
    if not interpreting():
        BV = min(BV, 16 if BK >= 128 else 32)
    # tf32x3 (three TF32 passes) is close to IEEE fp32 on tensor cores; IEEE fp32 dots lower to
    # unrolled FMAs that take minutes to compile. The interpreter computes in fp32 either way.
    return {"BT": BT, "BK": BK, "BV": BV, "PREC": "ieee" if interpreting() else "tf32x3"}


def forward(q, k, v, g, beta, scale: float, h0, reset, store_states: bool = False, write_o: bool = True):
    """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g, beta [B, S, Hv] (contiguous, any float dtype),
    h0 [B, Hv, Dk, Dv] fp32, reset int32 [B, S]. Returns (o [B, S, Hv, Dv] in v's dtype,
    final state fp32, chunk-start states [B, Hv, NT, Dk, Dv] fp32 or an empty tensor)."""
    B, S, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    NT = triton.cdiv(S, BT)
    o = torch.empty_like(v) if write_o else v.new_empty(0)
    ht = torch.empty(B, Hv, Dk, Dv, dtype=torch.float32, device=v.device)
    states = torch.empty((B, Hv, NT, Dk, Dv) if store_states else (0,), dtype=torch.float32, device=v.device)
    blocks = _blocks(Dk, Dv)
    if B * Hv:
        _fwd[(B * Hv, triton.cdiv(Dv, blocks["BV"]))](q, k, v, g, beta, reset, h0, o, ht, states, S, Hk, Hv, Dk, Dv,
                                                     scale, NT, WRITE_O=write_o, STORE_STATES=store_states, **blocks)
    return o, ht, states


def backward(do, dht, q, k, v, g, beta, scale: float, h0, reset):
    """Gradients (dq, dk, dv, dg, dbeta in their inputs' dtypes, dh0 fp32) from do [B, S, Hv, Dv]
    and dht [B, Hv, Dk, Dv]. Re-runs the forward scan for the chunk-start states."""
    B, S, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    NT = triton.cdiv(S, BT)
    blocks = _blocks(Dk, Dv)
    NV = triton.cdiv(Dv, blocks["BV"])
    _, _, states = forward(q, k, v, g, beta, scale, h0, reset, store_states=True, write_o=False)
    f32 = dict(dtype=torch.float32, device=v.device)
    dq, dk = torch.empty(NV, B, S, Hv, Dk, **f32), torch.empty(NV, B, S, Hv, Dk, **f32)
    dg, dbeta = torch.empty(NV, B, S, Hv, **f32), torch.empty(NV, B, S, Hv, **f32)
    dv, dh0 = torch.empty(B, S, Hv, Dv, **f32), torch.empty(B, Hv, Dk, Dv, **f32)
    if B * Hv:
        _bwd[(B * Hv, NV)](q, k, v, g, beta, reset, states, do, dht, dq, dk, dv, dg, dbeta, dh0,
                           S, Hk, Hv, Dk, Dv, scale, NT, **blocks)
    # Each value block holds a share of dq, dk, dg, dbeta; each key head serves Hv / Hk value heads.
    dq, dk = (t.sum(0).view(B, S, Hk, Hv // Hk, Dk).sum(3) for t in (dq, dk))
    dg, dbeta = dg.sum(0), dbeta.sum(0)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0

"""Pure-PyTorch references of the Gated DeltaNet ops (Qwen3.5, Qwen3-Next): the gated delta rule,
the causal short convolution and the gated RMSNorm. Their signatures are the contract every
implementation of these ops takes; they favour clarity over speed.

Packed documents: `document_ids` [B, S] (ids non-decreasing along a row; None = one document per
row). The recurrent state and the convolution's window restart where the id changes, so a packed
row computes what each document computes alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _continues(document_ids: torch.Tensor | None, B: int, S: int, device: torch.device) -> torch.Tensor:
    """[B, S] bool: position t belongs to the document of position t - 1 (False at t = 0)."""
    if document_ids is None:
        same = torch.ones(B, S, dtype=torch.bool, device=device)
    else:
        same = F.pad(document_ids[:, 1:] == document_ids[:, :-1], (1, 0), value=True)
    same[:, 0] = False
    return same


CHUNK = 64  # tokens per chunk of the chunked gated delta rule (as transformers and fla-core)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or float64 for float64 inputs (verify's oracle runs the reference in float64)."""
    return torch.promote_types(dtype, torch.float32)


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          scale: float, initial_state: torch.Tensor | None = None,
                          document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token: exact and slow, the tests' independent oracle for
    `gated_delta` (same arguments and results; see there)."""
    B, S, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if Hv != Hk:
        q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    ct = _compute_dtype(v.dtype)
    q, k, v, g, beta = (t.to(ct) for t in (q, k, v, g, beta))
    state = (torch.zeros(B, Hv, Dk, Dv, dtype=ct, device=v.device) if initial_state is None
             else initial_state.to(ct))
    continues = _continues(document_ids, B, S, v.device)
    out = []
    for t in range(S):
        if t > 0:  # a new document starts from zeros; a row's first token from initial_state
            state = state * continues[:, t, None, None, None]
        state = state * g[:, t].exp()[..., None, None]
        k_t, v_t = k[:, t], v[:, t]  # [B, Hv, Dk], [B, Hv, Dv]
        delta = (v_t - torch.einsum("bhkv,bhk->bhv", state, k_t)) * beta[:, t, :, None]
        state = state + k_t[..., None] * delta[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    return torch.stack(out, dim=1).to(v.dtype), state


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule on whole sequences (no document restarts), in q's dtype.

    q, k: [N, H, S, Dk]; v: [N, H, S, Dv]; g, beta: [N, H, S]; state: [N, H, Dk, Dv], the state
    before the first token. Returns (o [N, H, S, Dv], the state after the last token).
    Per chunk of C tokens (gamma = cumulative log decay inside the chunk, Gam[i, j] =
    exp(gamma_i - gamma_j) for j <= i): the delta rule's writes u solve the unit lower-triangular
    (UT) system (I + strict_lower(beta k k^T * Gam)) u = beta v - beta exp(gamma) k S0, so the
    chunk costs a few C x C and C x D products instead of C sequential rank-one updates.
    """
    N, H, S, Dk = k.shape
    C = CHUNK
    pad = (C - S % C) % C  # padded tokens: k = v = beta = 0 and g = 0 leave the state untouched
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (S + pad) // C
    q, k, v = (t.reshape(N, H, n, C, t.shape[-1]) for t in (q * scale, k, v))
    gamma = g.reshape(N, H, n, C).cumsum(-1)
    beta = beta.reshape(N, H, n, C, 1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Masked before exp: above the diagonal gamma_i - gamma_j > 0 could overflow.
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    ut = (beta * k) @ k.transpose(-1, -2) * decay  # solve_triangular reads only its strict lower part
    u = torch.linalg.solve_triangular(ut, beta * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, beta * k * gamma.exp()[..., None], upper=False, unitriangular=True)
    attn = q @ k.transpose(-1, -2) * decay  # inside the chunk, causal, the diagonal included
    q_in = q * gamma.exp()[..., None]  # reads the state at the chunk's start
    k_out = k * (gamma[..., -1:] - gamma).exp()[..., None]  # writes, decayed to the chunk's end
    chunk_decay = gamma[..., -1].exp()[..., None, None]
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state  # the writes, less what the state already predicts
        out.append(q_in[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(out, dim=2).reshape(N, H, n * C, -1)[:, :, :S], state


def segment_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the flat position b * S + t where each segment starts, a segment being a row's
    run of one document (so every row starts one); a host sync."""
    B, S = document_ids.shape
    return (~_continues(document_ids, B, S, document_ids.device)).reshape(-1).nonzero().squeeze(1)


def _segments(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row cut at its document boundaries (one host sync), as a padded batch of segments.

    Returns index [N, L] (flat positions b * S + t of each segment's tokens, 0 past its end),
    valid [N, L] bool, and the row of each segment [N] (segments in row, then position, order)."""
    B, S = document_ids.shape
    starts_flat = segment_starts(document_ids)
    lengths = torch.diff(starts_flat, append=starts_flat.new_tensor([B * S]))
    L = int(lengths.max())
    offs = torch.arange(L, device=document_ids.device)
    valid = offs[None, :] < lengths[:, None]
    index = torch.where(valid, starts_flat[:, None] + offs[None, :], 0)
    return index, valid, starts_flat // S


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                scale: float, initial_state: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, chunked (UT transform, chunks of 64 tokens), in fp32.

    q, k: [B, S, Hk, Dk], L2-normalised by the caller; v: [B, S, Hv, Dv] with Hv a multiple of Hk
    (each key head serves Hv / Hk consecutive value heads); g: [B, S, Hv] log decay (<= 0);
    beta: [B, S, Hv] write strength in (0, 1); scale: the queries' scale (Dk ** -0.5);
    initial_state: [B, Hv, Dk, Dv] (None = zeros), the state before each row's first document.
    For every token: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q).
    Returns (o [B, S, Hv, Dv] in v's dtype, the state after the last token [B, Hv, Dk, Dv] fp32,
    float64 for float64 inputs).
    Packed documents are cut into segments (a host sync), each run alone: a row's first segment
    starts from initial_state, later ones from zeros; the final state is that after the row's
    last token.
    """
    B, S, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if Hv != Hk:
        q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    ct = _compute_dtype(v.dtype)
    state = (torch.zeros(B, Hv, Dk, Dv, dtype=ct, device=v.device) if initial_state is None
             else initial_state.to(ct))
    if document_ids is None or B * S == 0:
        o, state = _chunked(*(t.to(ct).transpose(1, 2) for t in (q, k, v, g, beta)), scale, state)
        return o.transpose(1, 2).to(v.dtype), state
    index, valid, row = _segments(document_ids)
    first = torch.ones_like(row, dtype=torch.bool)
    first[1:] = row[1:] != row[:-1]
    # Padding past a segment's end has beta = 0 and g = 0 (masked below): no write, no decay, so
    # a segment's state after its padding is its state after its last token.
    seg = [t.to(ct).reshape(B * S, *t.shape[2:])[index] * valid.view(*valid.shape, *(1,) * (t.dim() - 2))
           for t in (q, k, v, g, beta)]
    state0 = state[row] * first[:, None, None, None]
    o, final = _chunked(*(t.transpose(1, 2) for t in seg), scale, state0)
    o = o.transpose(1, 2)[valid].reshape(B, S, Hv, Dv)  # segments tile the rows in order
    last = torch.ones_like(first)
    last[:-1] = row[1:] != row[:-1]
    return o.to(v.dtype), final[last]


def short_conv(x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution over the sequence, then SiLU, in x's dtype.

    x: [B, S, C]; weight: [C, K] (tap K - 1 multiplies the current token); no token sees one of an
    earlier document. Returns [B, S, C]."""
    B, S, C = x.shape
    K = weight.shape[1]
    ids = torch.zeros(B, S, dtype=torch.long, device=x.device) if document_ids is None else document_ids
    y = x.float() * weight[:, K - 1].float()
    for j in range(1, K):
        earlier = F.pad(x.float(), (0, 0, j, 0))[:, :S]  # [B, S, C]: x at t - j (zeros before the row)
        same = F.pad(ids, (j, 0), value=-1)[:, :S] == ids  # [B, S]: t - j is in t's document
        y = y + earlier * same[..., None] * weight[:, K - 1 - j].float()
    return F.silu(y).to(x.dtype)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) * silu(gate) over the last dim, normalised and gated in fp32.

    x, gate: [..., D]; weight: [D]. The normalised x is cast back to x's dtype before the weight
    (as transformers' Qwen3.5 gated norm), the product returned in x's dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)

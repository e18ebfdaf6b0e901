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


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                scale: float, initial_state: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, token by token in fp32.

    q, k: [B, S, Hk, Dk], L2-normalised by the caller; v: [B, S, Hv, Dv] with Hv a multiple of Hk
    (each key head serves Hv / Hk consecutive value heads); g: [B, S, Hv] log decay (<= 0);
    beta: [B, S, Hv] write strength in (0, 1); scale: the queries' scale (Dk ** -0.5);
    initial_state: [B, Hv, Dk, Dv] (None = zeros), the state before each row's first document.
    For every token: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q).
    Returns (o [B, S, Hv, Dv] in v's dtype, the state after the last token [B, Hv, Dk, Dv] fp32).
    """
    B, S, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if Hv != Hk:
        q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    state = (torch.zeros(B, Hv, Dk, Dv, device=v.device) if initial_state is None
             else initial_state.float())
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

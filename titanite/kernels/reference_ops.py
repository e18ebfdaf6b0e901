"""Pure-PyTorch reference implementations of every kernel op. Signatures here are the contract."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32. x: [..., D] any float dtype; weight: [D]. Returns x's dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, half-split layout. q: [B, Hq, S, D], k: [B, Hk, S, D]; cos/sin: [B, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention. q: [B, Hq, S, D]; k, v: [B, Hk, S, D] with Hq % Hk == 0. Returns [B, Hq, S, D]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise. Same shapes, any float dtype."""
    return F.silu(gate) * up

"""Built-in implementations made of PyTorch ops: SDPA and flex attention, grouped-mm experts.

These are aten ops (or compiled from them), so they already have autograd, fake tensors and
torch.compile support; the custom-op ones live in `chunked_loss.py` and `triton/ops.py`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from titanite.kernels.registry import register
from titanite.kernels.reference_ops import swiglu


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the reference's matmuls run in: autocast's dtype when autocast is on for the
    tensors' device, else the promoted dtype of the inputs. Custom ops and grouped_mm are not
    autocast-aware, so implementations cast their inputs to this first."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


def block_causal_mask(document_ids: Tensor) -> Tensor:
    """bool [B, 1, S, S]: query i sees key j iff j <= i and both are in the same document."""
    S = document_ids.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=document_ids.device).tril()
    return (causal & (document_ids[:, :, None] == document_ids[:, None, :])).unsqueeze(1)


@register("attention", "sdpa")
def sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, document_ids: Tensor | None = None) -> Tensor:
    """F.scaled_dot_product_attention: is_causal (flash / efficient kernels) for whole sequences,
    an explicit block-causal mask for packed documents."""
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    # Masked GQA reaches only the math kernel on some devices; repeating K/V keeps the
    # memory-efficient kernel available, at the cost of the repeated K/V.
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(document_ids), scale=scale)


_flex_cache: dict = {}


def _flex_block_mask(document_ids: Tensor | None, B: int, S: int, device: torch.device):
    """A flex BlockMask; reused while the same document_ids tensor comes back (every layer of a step)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("causal", S, str(device)) if document_ids is None else ("docs", id(document_ids), S)
    hit = _flex_cache.get(key)
    if hit is not None and (document_ids is None or hit[0] is document_ids):
        return hit[1]
    if document_ids is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        block_mask = create_block_mask(mask_mod, None, None, S, S, device=device)
    else:
        docs = document_ids

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])
        block_mask = create_block_mask(mask_mod, B, None, S, S, device=device)
    _flex_cache.clear()  # one step's mask at a time; the next batch brings new document ids
    _flex_cache[key] = (document_ids, block_mask)
    return block_mask


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@register("attention", "flex", devices=("cuda",))
def flex(q: Tensor, k: Tensor, v: Tensor, scale: float, document_ids: Tensor | None = None) -> Tensor:
    """flex_attention (compiled) with a causal or block-causal BlockMask: skips fully masked
    blocks, so packed documents cost only their own blocks. No CPU backward, hence CUDA only."""
    B, _, S, _ = q.shape
    block_mask = _flex_block_mask(document_ids, B, S, q.device)
    return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@register("moe.experts", "grouped_mm", devices=("cpu", "cuda"),
          dtypes=(torch.float32, torch.bfloat16))
def grouped_mm(x: Tensor, counts: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """torch._grouped_mm for both GEMMs: one launch per GEMM, no host sync on CUDA's bf16 fast
    path (sm90+; other GPUs and dtypes take PyTorch's per-group fallback)."""
    dtype = compute_dtype(x, w_gate_up, w_down)
    offs = counts.cumsum(0).to(torch.int32)
    inter = w_down.shape[-1]
    gate_up = torch._grouped_mm(x.to(dtype), w_gate_up.to(dtype).transpose(-2, -1), offs=offs)
    h = swiglu(gate_up[:, :inter], gate_up[:, inter:])
    return torch._grouped_mm(h, w_down.to(dtype).transpose(-2, -1), offs=offs).to(x.dtype)

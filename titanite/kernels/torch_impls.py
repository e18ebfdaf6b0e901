"""Built-in implementations made of PyTorch ops: SDPA and flex attention, gather-only MoE
dispatch, grouped-mm experts.

These are aten ops (or compiled from them), so they already have autograd, fake tensors and
torch.compile support; the custom-op ones live in `chunked_loss.py` and `triton/ops.py`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from titanite.kernels.registry import register
from titanite.kernels.reference_ops import block_causal_mask, causal_mask, moe_experts, swiglu

log = logging.getLogger("titanite")


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the reference's matmuls run in: autocast's dtype when autocast is on for the
    tensors' device, else the promoted dtype of the inputs. Custom ops and grouped_mm are not
    autocast-aware, so implementations cast their inputs to this first."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


@register("attention", "sdpa")
def sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, document_ids: Tensor | None = None) -> Tensor:
    """F.scaled_dot_product_attention: is_causal (flash / efficient kernels) for whole sequences,
    no mask for one new token over a KV cache, an explicit mask for a chunk over a cache or for
    packed documents."""
    gqa = q.shape[1] != k.shape[1]
    q_len, kv_len = q.shape[2], k.shape[2]
    if document_ids is None:
        if q_len == kv_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        mask = None if q_len == 1 else causal_mask(q_len, kv_len, q.device)  # one token sees every key
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    # Masked GQA reaches only the math kernel on some devices; repeating K/V keeps the
    # memory-efficient kernel available, at the cost of the repeated K/V.
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(document_ids), scale=scale)


_flex_cache: dict = {}


def _flex_block_mask(document_ids: Tensor | None, B: int, q_len: int, kv_len: int, device: torch.device):
    """A flex BlockMask; reused while the same document_ids tensor comes back (every layer of a step)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("causal", q_len, kv_len, str(device)) if document_ids is None else ("docs", id(document_ids), q_len)
    hit = _flex_cache.get(key)
    if hit is not None and (document_ids is None or hit[0] is document_ids):
        return hit[1]
    if document_ids is None:
        offset = kv_len - q_len  # the queries are the last q_len positions

        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx
        block_mask = create_block_mask(mask_mod, None, None, q_len, kv_len, device=device)
    else:
        docs = document_ids

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])
        block_mask = create_block_mask(mask_mod, B, None, q_len, kv_len, device=device)
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
    block_mask = _flex_block_mask(document_ids, q.shape[0], q.shape[2], k.shape[2], q.device)
    return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@register("moe.experts", "grouped_mm", devices=("cpu", "cuda"),
          dtypes=(torch.float32, torch.bfloat16))
def grouped_mm(x: Tensor, counts: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """torch._grouped_mm for both GEMMs: one launch per GEMM, no host sync on CUDA's bf16 fast
    path (sm90+; other GPUs and dtypes take PyTorch's per-group fallback)."""
    dtype = compute_dtype(x, w_gate_up, w_down)
    row_elems = 128 // torch.finfo(dtype).bits  # _grouped_mm needs 16-byte-aligned row strides
    hidden, inter = w_down.shape[-2:]
    if hidden % row_elems or inter % row_elems:
        _warn_unaligned(hidden, inter, dtype, row_elems)
        return moe_experts(x.to(dtype), counts, w_gate_up.to(dtype), w_down.to(dtype)).to(x.dtype)
    if dtype != torch.bfloat16 and torch.compiler.is_compiling():
        # _grouped_mm's fake (meta) kernel accepts only bf16, though the eager op runs fp32 and
        # fp16: under torch.compile other dtypes run eagerly, outside the graph. (Wrapped here,
        # not at import: torch.compiler.disable imports dynamo, and with it Triton.)
        return torch.compiler.disable(_grouped_mm_swiglu)(x, counts, w_gate_up, w_down, dtype)
    return _grouped_mm_swiglu(x, counts, w_gate_up, w_down, dtype)


def _grouped_mm_swiglu(x: Tensor, counts: Tensor, w_gate_up: Tensor, w_down: Tensor, dtype: torch.dtype) -> Tensor:
    offs = counts.cumsum(0).to(torch.int32)
    inter = w_down.shape[-1]
    gate_up = torch._grouped_mm(x.to(dtype), w_gate_up.to(dtype).transpose(-2, -1), offs=offs)
    h = swiglu(gate_up[:, :inter], gate_up[:, inter:])
    return torch._grouped_mm(h, w_down.to(dtype).transpose(-2, -1), offs=offs).to(x.dtype)


@functools.cache
def _warn_unaligned(hidden: int, inter: int, dtype: torch.dtype, row_elems: int) -> None:
    log.warning("moe.experts grouped_mm: hidden size %d and expert intermediate size %d must both be "
                "multiples of %d for %s; running a per-expert loop instead (same math, slower)",
                hidden, inter, row_elems, str(dtype).removeprefix("torch."))


class _PermuteRows(torch.autograd.Function):
    """out = x[index], with the backward given as a gather too: grad_x = grad[inverse], summed
    over groups of `fold` consecutive rows. Valid when `index` is a permutation of
    arange(len(x) * fold) // fold and `inverse` its inverse permutation, which is what dispatch
    has. Autograd's own backward for x[index] is an accumulating scatter (atomics on CUDA, a
    slow serial index_put on CPU); this one is plain reads, deterministic everywhere."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor, fold: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.fold = fold
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        grad_x = grad.index_select(0, inverse)
        if ctx.fold > 1:
            grad_x = grad_x.view(grad_x.shape[0] // ctx.fold, ctx.fold, *grad_x.shape[1:]).sum(dim=1)
        return grad_x, None, None, None


@register("moe.dispatch", "gather")
def gather_dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int, experts) -> Tensor:
    """The reference's permutation with both directions as gathers: forward and backward read
    rows by index and never scatter-add (2.4-3.4x faster than the reference's indexing on CPU at
    Qwen3-30B-A3B's routing, benchmarks/moe.py). Same results; input gradients differ from the
    reference only in summation order over the k slots."""
    T, K = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)  # slot (token * K + k) at each expert-sorted position
    inverse = order.argsort()  # sorted position of each slot
    counts = torch.bincount(flat, minlength=num_experts)
    y_sorted = experts(_PermuteRows.apply(x, order // K, inverse, K), counts)
    y = _PermuteRows.apply(y_sorted, inverse, order, 1).view(T, K, y_sorted.shape[-1])  # (token, k) order
    return (y * topk_weights.to(y.dtype).unsqueeze(-1)).sum(dim=1).to(x.dtype)

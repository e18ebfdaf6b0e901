"""Built-in implementations made of PyTorch ops: SDPA and flex attention, gather-only MoE
dispatch, grouped-mm experts.

These are aten ops (or compiled from them), so they already have autograd, fake tensors and
torch.compile support; the custom-op ones live in `chunked_loss.py` and `triton/ops.py`.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from titanite.kernels.reference_ops import block_causal_mask, causal_mask, moe_experts, swiglu
from titanite.kernels.registry import register

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
    no mask for one new token over a KV cache; a chunk of queries over a cache or a
    context-parallel chunk over the keys before it: on the CPU two flash calls merged exactly
    (`_PrefixCausal`, no mask), elsewhere an explicit mask (one per shape or ids tensor, shared
    by every layer). Packed whole sequences go span by span (`document_spans`): no [S, S] mask
    is ever built."""
    gqa = q.shape[1] != k.shape[1]
    q_len, kv_len = q.shape[2], k.shape[2]
    if document_ids is None:
        if q_len == kv_len:  # no mask at all: the kernels skip the blocks above the diagonal
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        if q_len > 1 and q.is_cpu and not torch.compiler.is_compiling():  # no mask: two blocks, merged exactly
            dtype = compute_dtype(q, k, v)
            with torch.autocast("cpu", enabled=False):
                return _PrefixCausal.apply(q.to(dtype), k.to(dtype), v.to(dtype), scale)
        mask = None if q_len == 1 else _shared_mask(("causal", q_len, kv_len, q.device), None, compute_dtype(q, k, v),
                                                    lambda: causal_mask(q_len, kv_len, q.device))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    # The spans are read from the ids on the host: free for a CPU tensor, a drained queue every
    # step on an accelerator (and nothing to read on meta), where the mask path runs instead
    # (`flex` is the packed-documents kernel for GPUs); a chunk of queries over earlier keys
    # (context parallelism) takes the mask path too.
    if not document_ids.is_cpu or q_len != kv_len:
        mask = _shared_mask(("docs", q_len), document_ids, compute_dtype(q, k, v),
                            lambda: block_causal_mask(document_ids, q_len))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if torch.compiler.is_compiling():
        # The spans are read from the ids on the host: a compiled graph would specialise on
        # them and recompile for every batch. (Wrapped here: torch.compiler.disable imports dynamo.)
        return torch.compiler.disable(_packed_sdpa)(q, k, v, scale, document_ids)
    return _packed_sdpa(q, k, v, scale, document_ids)


class _PrefixCausal(torch.autograd.Function):
    """Causal attention of Sq queries that are the last positions of Sk > Sq keys (a chunk over
    a KV cache, or a context-parallel chunk over its key prefix) on the CPU, without a mask:
    the keys before the queries (visible to all) and the queries' own block (causal) are two
    flash-attention calls, merged by their log-sum-exps. The backward runs each block's flash
    backward with the merged output and log-sum-exp, which gives each block's exact share of the
    gradient (the softmax over both blocks). Memory O(S), where a mask would be Sq x Sk."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        split = k.shape[2] - q.shape[2]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        before, lse_before = flash(q, k[:, :, :split], v[:, :, :split], 0.0, False, scale=scale)
        own, lse_own = flash(q, k[:, :, split:], v[:, :, split:], 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_before, lse_own)  # [B, Hq, Sq], fp32
        out = (before.float() * (lse_before - lse).exp()[..., None]
               + own.float() * (lse_own - lse).exp()[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        split = k.shape[2] - q.shape[2]
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        dq_before, dk_before, dv_before = backward(grad, q, k[:, :, :split], v[:, :, :split], out, lse, 0.0, False,
                                                   scale=ctx.scale)
        dq_own, dk_own, dv_own = backward(grad, q, k[:, :, split:], v[:, :, split:], out, lse, 0.0, True,
                                          scale=ctx.scale)
        return dq_before + dq_own, torch.cat([dk_before, dk_own], 2), torch.cat([dv_before, dv_own], 2), None


_masks: dict = {}  # (kind, q_len, ..., dtype) -> (the ids it was built from or None, mask)


def _shared_mask(key: tuple, ids: Tensor | None, dtype: torch.dtype, build) -> Tensor:
    """The additive mask (0 where allowed, -inf elsewhere, in the dtype attention computes in) of the boolean
    one `build` makes for `key` (and, for document masks, the very ids tensor `ids` at its
    current version), built once and reused by every layer: autograd then keeps one copy for
    the backward. (A boolean mask would be converted inside every call and each layer would keep
    its own copy: measured, 4 bytes per element per layer.) A document mask for new ids first
    drops those of other ids (a new micro-batch: its predecessor's are done, and holding them
    would double the masks' memory); at most a few are held."""
    key = (*key, dtype) if ids is None else (*key, dtype, id(ids), ids._version)
    hit = _masks.get(key)
    if hit is not None and hit[0] is ids:
        return hit[1]
    if ids is not None:  # prefixes of one micro-batch's ids (context parallelism) share their base
        base = _base(ids)
        for stale in [k for k, (other, _) in _masks.items() if other is not None and _base(other) is not base]:
            del _masks[stale]
    if len(_masks) >= 4:
        _masks.clear()
    allowed = build()
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    _masks[key] = (ids, mask)
    return mask


# Short documents are attended together, in groups of up to this many tokens with a mask of
# the group's size; a longer document is one causal call without a mask. Groups bound the number
# of calls (at most 2 S / _GROUP_TOKENS + 1 per row) and each mask (_GROUP_TOKENS² per row).
# Measured on a CPU, fp32, S = 8192, Hq 8, Hk 2, D 64, one thread, forward + backward: with
# 2044 documents of ~4 tokens, 0.13 s one call per document, 0.10 s groups of 64, 0.11 s of 128,
# 0.17 s of 256, 0.54 s of 1024; with 242 of ~32: 0.09 / 0.09 / 0.11 / 0.17 / 0.52 s; with 36 of
# ~256 or 3 long ones, every size within 5% up to 512. 128: within 20% of the best, and half the
# calls of 64 where a call costs more than its arithmetic (a GPU launch).
_GROUP_TOKENS = 128
_spans_cache: list = [None, -1, None]  # (the document ids last seen, their version, their spans)


def document_spans(document_ids: Tensor, group_tokens: int = _GROUP_TOKENS) -> list[tuple[tuple[int, bool], ...]]:
    """Per row of document ids [B, S]: consecutive spans (length, causal) covering the row, such
    that no token attends outside its span. A span is whole documents: one document (causal:
    plain causal attention over it is the row's block-causal attention) or several short ones
    grouped up to `group_tokens` tokens (causal False: a mask from the ids, over the span only).

    A document is a contiguous run of one id; padding is a run of its own. An id that comes back
    after another document (not what packing makes, but the reference allows it) joins every run
    between into one masked span, so the result stays exact. The ids must be a CPU tensor (read
    through numpy: no device queue to drain)."""
    ids = document_ids.detach().numpy().astype(np.int64)  # a CPU tensor (the caller's check): no device read
    B, S = ids.shape
    pos = np.arange(S)
    layouts = []
    for row in ids:
        # last[t]: the last position of token t's id; a span may end after t only if every id
        # seen so far ends there too.
        _, inverse = np.unique(row, return_inverse=True)
        last_of = np.zeros(int(inverse.max()) + 1, dtype=np.int64)
        np.maximum.at(last_of, inverse, pos)
        end = np.flatnonzero(np.maximum.accumulate(last_of[inverse]) == pos)  # blocks of whole documents end here
        runs = np.concatenate([[1], (row[1:] != row[:-1]).astype(np.int64)]).cumsum()  # runs started up to t
        lengths = np.diff(end, prepend=-1).tolist()
        single = (np.diff(runs[end], prepend=0) == 1).tolist()
        layouts.append(_group(lengths, single, group_tokens))
    return layouts


def _group(lengths: list[int], single: list[bool], limit: int) -> tuple[tuple[int, bool], ...]:
    """Consecutive blocks (lengths, single: one run of one id) gathered into spans of at most
    `limit` tokens, or one block alone where it is longer."""
    spans: list[tuple[int, bool]] = []
    size, members = 0, []
    for n, one in zip(lengths, single):
        if members and size + n > limit:
            spans.append((size, len(members) == 1 and members[0]))
            size, members = 0, []
        size += n
        members.append(one)
    spans.append((size, len(members) == 1 and members[0]))
    return tuple(spans)


def _cached_spans(document_ids: Tensor) -> list[tuple[tuple[int, bool], ...]]:
    """document_spans, computed once per ids tensor: every layer of a step passes the same one."""
    if _spans_cache[0] is document_ids and _spans_cache[1] == document_ids._version:
        return _spans_cache[2]
    layouts = document_spans(document_ids, _GROUP_TOKENS)
    _spans_cache[:] = [document_ids, document_ids._version, layouts]
    return layouts


def _packed_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, document_ids: Tensor) -> Tensor:
    """Block-causal attention span by span: rows that share one layout go together, other rows
    one at a time. split / cat keep the backward a concatenation (no full-size zeros per span)."""
    layouts = _cached_spans(document_ids)
    if all(spans == layouts[0] for spans in layouts):
        return _attend_spans(q, k, v, scale, document_ids, layouts[0])
    rows = zip(q.split(1), k.split(1), v.split(1), document_ids.split(1), layouts)
    return torch.cat([_attend_spans(*row[:3], scale, *row[3:]) for row in rows])


def _attend_spans(q: Tensor, k: Tensor, v: Tensor, scale: float, document_ids: Tensor,
                  spans: tuple[tuple[int, bool], ...]) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    sizes = [n for n, _ in spans]
    outs = []
    for (_, causal), qs, ks, vs, ids in zip(spans, q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2),
                                            document_ids.split(sizes, 1)):
        mask = None if causal else block_causal_mask(ids)  # [B, 1, n, n]: n <= _GROUP_TOKENS but where ids come back
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale,
                                                   enable_gqa=gqa))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


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
        docs, offset = document_ids, kv_len - q_len  # the queries are the last q_len positions

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx + offset >= kv_idx) & (docs[b, q_idx + offset] == docs[b, kv_idx])
        block_mask = create_block_mask(mask_mod, B, None, q_len, kv_len, device=device)
    if document_ids is not None:  # new ids: a new micro-batch; its predecessor's masks are done
        base = _base(document_ids)
        for stale in [k for k, (ids, _) in _flex_cache.items() if ids is not None and _base(ids) is not base]:
            del _flex_cache[stale]
    if len(_flex_cache) >= 4:
        _flex_cache.clear()
    _flex_cache[key] = (document_ids, block_mask)
    return block_mask


def _base(ids: Tensor) -> Tensor:
    """The tensor `ids` is a view of (itself when it is none): a micro-batch's context-parallel
    prefixes share their base."""
    return ids if ids._base is None else ids._base


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

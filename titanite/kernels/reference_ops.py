"""Pure-PyTorch reference implementations of every kernel op. Their signatures are the contract.

Every other implementation takes the same parameters (names, order, defaults) and is verified
against these, forward and backward (`titanite kernels verify`). They favour clarity over speed:
attention materialises the score matrix, the experts loop over experts, the loss materialises
the logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, normalised in fp32. x: [..., D] any float dtype; weight: [D].

    Returns weight * normalised-x-cast-back-to-x.dtype, i.e. dtype promote(x.dtype, weight.dtype).
    """
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


def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [q_len, kv_len]: the queries are the last q_len positions of the kv_len ones (a KV
    cache holds the earlier ones), and query i sees keys up to its own position."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=kv_len - q_len)


def block_causal_mask(document_ids: torch.Tensor, q_len: int | None = None) -> torch.Tensor:
    """bool [B, 1, Sq, S] from document ids [B, S]: the queries are the last Sq = q_len
    positions (default all S), and query i sees key j iff j is not after it and both are in the
    same document (packed samples)."""
    S = document_ids.shape[1]
    q_len = S if q_len is None else q_len
    same = document_ids[:, S - q_len:, None] == document_ids[:, None, :]  # [B, Sq, S]
    return (causal_mask(q_len, S, document_ids.device) & same)[:, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention. q: [B, Hq, Sq, D]; k, v: [B, Hk, Sk, D] with Hq % Hk == 0 and
    Sq <= Sk: the queries are the last Sq positions (Sq < Sk when earlier keys come from a KV
    cache), and each sees the keys up to its own position.

    document_ids: optional int [B, Sk], the documents of the keys; when given, a token attends
    only to earlier tokens of its own document (block-causal, for packed sequences; Sq < Sk is a
    context-parallel chunk of queries over the keys before it). Softmax in fp32. Returns
    [B, Hq, Sq, D] in q's dtype.
    """
    rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale  # [B, Hq, Sq, Sk]
    if document_ids is None:
        allowed = causal_mask(q.shape[2], k.shape[2], q.device)
    else:
        assert document_ids.shape[1] == k.shape[2], "document_ids must cover the keys"
        allowed = block_causal_mask(document_ids, q.shape[2])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vf).to(q.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise. Same shapes, any float dtype."""
    return F.silu(gate) * up


def moe_router(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing. x: [T, H]; weight: [E, H]; bias: optional fp32 [E] that only steers
    the choice (aux-loss-free balancing), never the weights.

    Returns (probs fp32 [T, E] = softmax(x W^T) in fp32, topk_weights fp32 [T, K], topk_ids
    int64 [T, K]); topk_weights are renormalised to sum to 1 when norm_topk_prob.
    """
    probs = F.linear(x, weight).float().softmax(dim=-1)
    return (probs, *select_experts(probs, top_k, norm_topk_prob, bias))


def select_experts(probs: torch.Tensor, top_k: int, norm_topk_prob: bool,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice from its fp32 probabilities [T, E]: (topk_weights fp32 [T, K],
    topk_ids int64 [T, K]). `bias` steers only the choice; the weights are the probabilities
    of the chosen experts, renormalised to sum to 1 when norm_topk_prob."""
    choice = probs if bias is None else probs + bias
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = probs.gather(-1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def moe_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                 experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Permute tokens to their experts, run `experts`, un-permute and combine.

    x: [T, H]; topk_ids: int64 [T, K]; topk_weights: [T, K] (any float dtype). experts(x_sorted
    [T*K, H] grouped by expert id ascending, counts int64 [num_experts]) -> [T*K, H]. Returns
    sum_k topk_weights[t, k] * expert_out[t, k] as [T, H] in x's dtype.
    """
    T, K = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)  # slot (token * K + k) at each sorted position
    counts = torch.bincount(flat, minlength=num_experts)
    y_sorted = experts(x[order // K], counts)
    y = y_sorted[order.argsort()].view(T, K, y_sorted.shape[-1])  # back to (token, k) order
    return (y * topk_weights.to(y.dtype).unsqueeze(-1)).sum(dim=1).to(x.dtype)


def moe_experts(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Grouped SwiGLU MLP. x: [N, H] with rows grouped by expert (counts[e] rows for expert e, in
    order; counts int64 [E], sum = N). w_gate_up: [E, 2I, H] (gate rows first, then up);
    w_down: [E, H, I]. Row n of expert e: w_down[e] @ (silu(gate) * up). Returns [N, H], x's dtype.
    """
    assert int(counts.sum()) == x.shape[0], f"counts sum to {int(counts.sum())}, x has {x.shape[0]} rows"
    inter = w_down.shape[-1]
    outs = []
    # unbind views: each expert's weight gradient is a slice of one stacked gradient, not a
    # full-size zero tensor per expert as indexing w[e] would give.
    for rows, w_gu, w_d in zip(x.split(counts.tolist()), w_gate_up.unbind(0), w_down.unbind(0)):
        gate_up = rows @ w_gu.t()
        outs.append(swiglu(gate_up[:, :inter], gate_up[:, inter:]) @ w_d.t())
    return torch.cat(outs).to(x.dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed token cross-entropy of the final linear layer, in fp32.

    hidden: [N, H]; weight: [V, H]; labels: int64 [N] (ignore_index skipped). Returns an fp32
    scalar: sum over valid tokens of -log softmax(hidden @ weight^T)[label].
    """
    logits = hidden @ weight.t()  # [N, V]: what every other implementation avoids holding
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")

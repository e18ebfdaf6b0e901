"""Training FLOPs per token of a Qwen3 / Qwen3-MoE architecture, for MFU and the estimate.

Both backends run the same math, so they count it once, here, from `Qwen3Args`.
"""

from __future__ import annotations

from titanite.models.qwen3.args import Qwen3Args


def flops_per_token(a: Qwen3Args, seq_len: int) -> float:
    """6 x (parameters a token passes through, head included) + attention scores and values.

    Attention: per layer and token, QK^T and AV are 2 * 2 * S * Hq * D forward FLOPs for the
    full (non-causal) square; x3 for backward. The causal half is not discounted, as is usual.
    """
    attn_proj = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
    dense_mlp = 3 * a.hidden_size * a.intermediate_size
    active_mlp = 3 * a.hidden_size * a.moe_intermediate_size * a.num_experts_per_tok + a.hidden_size * a.num_experts
    matmul_params = a.hidden_size * a.vocab_size  # output head
    for i in range(a.num_layers):
        matmul_params += attn_proj + (active_mlp if a.layer_is_moe(i) else dense_mlp)
    attention = 12 * a.num_layers * a.num_heads * a.head_dim * seq_len
    return 6 * matmul_params + attention

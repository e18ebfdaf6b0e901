"""Training FLOPs per token of a Qwen3 / Qwen3-MoE architecture, for MFU and the estimate.

Both backends run the same math, so they count it once, here, from `Qwen3Args`.
"""

from __future__ import annotations

from titanite.models.qwen3.args import Qwen3Args


def _active_expert_params(a: Qwen3Args) -> int:
    return sum(3 * a.hidden_size * a.moe_intermediate_size * a.num_experts_per_tok
               for i in range(a.num_layers) if a.layer_is_moe(i))


def lora_flops_per_token(a: Qwen3Args, seq_len: int, linear_adapter_params: int, experts_adapted: bool,
                         first_qkv_a_params: int = 0) -> float:
    """The same for a LoRA run: the frozen weights need no weight gradients, so their matmuls
    cost 2 (forward) + 2 (input gradient) per parameter instead of 6; the adapters of linear
    layers (`linear_adapter_params`, A and B of each) cost 6. Nothing before layer 0 trains, so
    the input gradient of layer 0's q/k/v projections (base, and the A factors of their
    adapters, `first_qkv_a_params`) is never computed. Adapted MoE experts run on
    W + scale * B @ A, whose gradient is computed, so the active experts keep their 6 (building
    W + BA once per micro-batch is not counted: it does not grow with the tokens). With target
    subsets that leave layer 0's attention without adapters, autograd skips more input
    gradients than counted here, so the count is an upper bound."""
    full = flops_per_token(a, seq_len)
    attention = 12 * a.num_layers * a.num_heads * a.head_dim * seq_len
    matmul = (full - attention) / 6
    trained = _active_expert_params(a) if experts_adapted else 0
    first_qkv = a.hidden_size * a.head_dim * (a.num_heads + 2 * a.num_kv_heads)
    return (4 * matmul + 2 * trained + 6 * linear_adapter_params - 2 * (first_qkv + first_qkv_a_params)
            + attention)


def layer_flops(a: Qwen3Args, i: int, seq_len: int) -> float:
    """Training FLOPs per token of transformer block `i` (its matmuls and its attention)."""
    attn_proj = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
    dense_mlp = 3 * a.hidden_size * a.intermediate_size
    active_mlp = 3 * a.hidden_size * a.moe_intermediate_size * a.num_experts_per_tok + a.hidden_size * a.num_experts
    return 6 * (attn_proj + (active_mlp if a.layer_is_moe(i) else dense_mlp)) + 12 * a.num_heads * a.head_dim * seq_len


def head_flops(a: Qwen3Args) -> float:
    """Training FLOPs per token of the output head."""
    return 6 * a.hidden_size * a.vocab_size


def flops_per_token(a: Qwen3Args, seq_len: int) -> float:
    """6 x (parameters a token passes through, head included) + attention scores and values.

    Attention: per layer and token, QK^T and AV are 2 * 2 * S * Hq * D forward FLOPs for the
    full (non-causal) square; x3 for backward. The causal half is not discounted, as is usual.
    """
    return head_flops(a) + sum(layer_flops(a, i, seq_len) for i in range(a.num_layers))

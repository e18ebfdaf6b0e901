"""Training FLOPs per token of a Qwen3 / Qwen3-MoE / Qwen3.5 / Qwen3-Next architecture, for MFU
and the estimate.

Both backends run the same math, so they count it once, here, from `Qwen3Args`.

Gated DeltaNet layers (Qwen3.5, Qwen3-Next) cost their projections like any matmul, plus the
chunked gated delta rule (fla's chunk_gated_delta_rule, chunk C = 64), counted per token and
value head (Dk, Dv the head widths) as forward multiply-adds:
  3 Dk Dv (the state read by the queries and by the keys, and its update)
  + C (3 Dk + 2 Dv) (the in-chunk k k^T, q k^T, the w and u transforms and the in-chunk output)
  + C^2 / 3 (the chunk's triangular solve),
x 2 FLOPs per multiply-add, x 3 for forward and backward. An approximation: it ignores the
elementwise work (gates, norms, the conv's SiLU) as the attention count does, and that the
last chunk of a sequence may be short. With Dk = Dv = 128 it is about 6% of a layer's
projections; the depthwise conv counts as C_conv x K parameters.
"""

from __future__ import annotations

from titanite.models.qwen3.args import Qwen3Args

DELTA_CHUNK = 64  # the chunk length of the chunked delta rule, for its FLOPs


def input_params(a: Qwen3Args, i: int) -> int:
    """Parameters of layer i's token mixer before its output projection (q/k/v; for Gated
    DeltaNet q/k/v/z/b/a and the conv)."""
    H = a.hidden_size
    if a.layer_is_linear(i):
        keys, values = a.linear_num_key_heads * a.linear_key_head_dim, a.linear_num_value_heads * a.linear_value_head_dim
        return H * (2 * keys + 2 * values + 2 * a.linear_num_value_heads) + (2 * keys + values) * a.linear_conv_kernel_dim
    queries = a.num_heads * a.head_dim * (2 if a.attn_output_gate else 1)  # the output gate doubles q_proj
    return H * (queries + 2 * a.num_kv_heads * a.head_dim)


def mixer_params(a: Qwen3Args, i: int) -> int:
    """Parameters a token passes through in layer i's token mixer (attention or Gated DeltaNet)."""
    heads = (a.linear_num_value_heads * a.linear_value_head_dim if a.layer_is_linear(i)
             else a.num_heads * a.head_dim)
    return input_params(a, i) + heads * a.hidden_size


def mixing_flops(a: Qwen3Args, i: int, seq_len: int) -> float:
    """Training FLOPs per token of layer i's token mixing beyond its weights: attention scores
    and values over seq_len, or the chunked delta rule (see the module docstring)."""
    if not a.layer_is_linear(i):
        return 12 * a.num_heads * a.head_dim * seq_len
    dk, dv, c = a.linear_key_head_dim, a.linear_value_head_dim, DELTA_CHUNK
    return 6 * a.linear_num_value_heads * (3 * dk * dv + c * (3 * dk + 2 * dv) + c * c / 3)


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
    attention = sum(mixing_flops(a, i, seq_len) for i in range(a.num_layers))
    matmul = (full - attention) / 6
    trained = _active_expert_params(a) if experts_adapted else 0
    first_qkv = input_params(a, 0)
    return (4 * matmul + 2 * trained + 6 * linear_adapter_params - 2 * (first_qkv + first_qkv_a_params)
            + attention)


def layer_flops(a: Qwen3Args, i: int, seq_len: int) -> float:
    """Training FLOPs per token of transformer block `i` (its matmuls and its token mixing)."""
    dense_mlp = 3 * a.hidden_size * a.intermediate_size
    shared = 3 * a.hidden_size * a.shared_expert_intermediate_size + (a.hidden_size if a.shared_expert_intermediate_size else 0)
    active_mlp = (3 * a.hidden_size * a.moe_intermediate_size * a.num_experts_per_tok + a.hidden_size * a.num_experts
                  + shared)
    return 6 * (mixer_params(a, i) + (active_mlp if a.layer_is_moe(i) else dense_mlp)) + mixing_flops(a, i, seq_len)


def head_flops(a: Qwen3Args) -> float:
    """Training FLOPs per token of the output head."""
    return 6 * a.hidden_size * a.vocab_size


def flops_per_token(a: Qwen3Args, seq_len: int) -> float:
    """6 x (parameters a token passes through, head included) + attention scores and values.

    Attention: per layer and token, QK^T and AV are 2 * 2 * S * Hq * D forward FLOPs for the
    full (non-causal) square; x3 for backward. The causal half is not discounted, as is usual.
    """
    return head_flops(a) + sum(layer_flops(a, i, seq_len) for i in range(a.num_layers))

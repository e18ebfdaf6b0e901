"""The planner's counts for Qwen3.5 / Qwen3-Next layers (`Qwen3Args.is_hybrid`): Gated DeltaNet
(linear attention) blocks, gated full attention and the MoE's shared expert.

Parameters, per layer (titanite/models/qwen3/hybrid.py; K = Hk Dk keys, V = Hv Dv values,
C_conv = 2K + V conv channels, Kc the conv kernel):
- Gated DeltaNet: the fused w_qkvz [2K + 2V, H] and w_ba [2 Hv, H], conv_weight [C_conv, Kc],
  A_log and dt_bias [Hv], the gated norm's weight [Dv], wo [H, V];
- gated attention: Qwen3's attention with q_proj doubled (a sigmoid gate per query row);
- the shared expert: a SwiGLU of shared_expert_intermediate_size and its gate [1, H].

Activations of a Gated DeltaNet block, per token, as the reference / torch path (the default
off CUDA) keeps them for backward, fp32 units (counted as such whatever the compute dtype):
- the w_qkvz output (the conv reads q|k|v, the gated norm reads z), the conv's Kc shifted,
  masked taps and its pre-SiLU sum, its output (q, k, v; l2norm keeps it), the l2norms' rsqrt;
  the decay's softplus input and output, beta;
- the chunked delta rule (titanite/kernels/reference_delta.py, chunks of C = 64), per value head:
  10 Dk + 4 Dv + 5 C + 4 values and the state [Dk, Dv] at every chunk boundary (Dk Dv / C per
  token): the padded and scaled copies of q, k, v, beta k (twice) and beta v, the UT solves'
  inputs and outputs (u, w), the in-chunk decay, k k^T, q k^T and their masked products, q and k
  decayed to the chunk's edges, the per-chunk slices matmul copies, v_new and the output. The
  coefficients were read off the profiler (tests/plan/test_hybrid_plan.py holds a whole block to
  the measured bytes); they leave out the last chunk's padding and the few states of a sequence
  (its final state, about 1.25 Dk Dv per sequence per head);
- the gated norm: rsqrt, normalised, weighted, silu(z) and its output (wo's input).
fla-core's CUDA kernels keep far less (they recompute the chunk intermediates); the estimate
counts the reference path, an upper bound there. Under 'selective' checkpointing a block keeps
its mm and bmm outputs: w_qkvz, w_ba and wo, and per value head the chunk's k k^T, q k^T, three
[C, Dv] products per chunk and the state update.

Tensor parallelism of these layers is not planned yet (the native plan does not split them):
`check_hybrid` refuses it, with context and pipeline parallelism, which preflight refuses.
"""

from __future__ import annotations

from titanite.core.errors import UserError
from titanite.models.qwen3.args import Qwen3Args

DELTA_CHUNK = 64  # tokens per chunk of the reference's chunked delta rule


def check_hybrid(a: Qwen3Args, tp: int) -> None:
    """Refuse the layouts the planner cannot count for a hybrid model (cp and pp: preflight)."""
    if a.is_hybrid and tp > 1:
        raise UserError(f"config key 'parallelism.tp' = {tp}: the estimate does not plan tensor parallelism of "
                        "Gated DeltaNet layers yet; set parallelism.tp = 1 (shard with FSDP and, for MoE, "
                        "parallelism.ep)")


def linear_shapes(a: Qwen3Args) -> list[tuple[int, int]]:
    """A Gated DeltaNet mixer's parameters as (rows, row elements), norms excluded."""
    H, Hv = a.hidden_size, a.linear_num_value_heads
    keys, values = a.linear_num_key_heads * a.linear_key_head_dim, Hv * a.linear_value_head_dim
    return [(2 * keys + 2 * values, H), (2 * Hv, H), (2 * keys + values, a.linear_conv_kernel_dim),
            (Hv, 1), (Hv, 1), (a.linear_value_head_dim, 1), (H, values)]


def shared_expert_shapes(a: Qwen3Args) -> list[tuple[int, int]]:
    """The shared expert (w1, w3, w2) and its gate, as (rows, row elements); none without one."""
    H, Is = a.hidden_size, a.shared_expert_intermediate_size
    return [(Is, H), (Is, H), (H, Is), (1, H)] if Is else []


def delta_values(a: Qwen3Args) -> float:
    """Per token and value head: what the chunked delta rule keeps (module docstring)."""
    dk, dv, c = a.linear_key_head_dim, a.linear_value_head_dim, DELTA_CHUNK
    return 10 * dk + 4 * dv + 5 * c + 4 + dk * dv / c


def linear_mixer_elems(a: Qwen3Args, fp32: float = 1.0) -> float:
    """What a Gated DeltaNet mixer keeps per token without checkpointing, in compute-dtype units
    (`fp32`: the size of an fp32 value in them, 4 / bytes per value)."""
    Hk, Hv = a.linear_num_key_heads, a.linear_num_value_heads
    keys, values = Hk * a.linear_key_head_dim, Hv * a.linear_value_head_dim
    channels = 2 * keys + values
    projections = 2 * keys + 2 * values  # w_qkvz's output, in the compute dtype
    conv = (a.linear_conv_kernel_dim + 1) * channels  # taps and pre-SiLU sum, the output
    gates = 2 * Hk + 3 * Hv  # l2norm rsqrt; softplus in and out, beta
    norm = 4 * values + Hv
    return projections + fp32 * (conv + gates + Hv * delta_values(a) + norm)


def linear_mixer_kept(a: Qwen3Args, fp32: float = 1.0) -> float:
    """What a Gated DeltaNet mixer keeps per token under selective checkpointing (mm and bmm
    outputs; module docstring)."""
    Hv, dk, dv, c = a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim, DELTA_CHUNK
    keys, values = a.linear_num_key_heads * dk, Hv * dv
    return 2 * keys + 2 * values + 2 * Hv + a.hidden_size + fp32 * Hv * (2 * c + 3 * dv + dk * dv / c)


def gated_attention_extra(a: Qwen3Args, tp: int, selective: bool) -> float:
    """Gated attention's values per token beyond Qwen3 attention's: the gate half of q_proj, its
    sigmoid and the gated product (selective: the gate half only)."""
    if not a.attn_output_gate:
        return 0.0
    q = a.num_heads // tp * a.head_dim
    return q if selective else 3 * q


def shared_expert_elems(a: Qwen3Args, selective: bool) -> float:
    """The shared expert's SwiGLU over every token, its sigmoid gate and the gated product
    (selective: its matmul outputs and the gate's)."""
    Is, H = a.shared_expert_intermediate_size, a.hidden_size
    if not Is:
        return 0.0
    return 2 * Is + H + 1 if selective else 4 * Is + H + 2

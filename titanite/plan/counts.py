"""The counting rules every part of the plan shares: the parameter tensors a rank holds, FSDP's
sharding and its transient copies, and the activations a micro-batch keeps for backward.

Everything is counted from the architecture (config.json or the flavor) and `[parallelism]`,
with the sharding rules titanite applies (parallel/): tensor parallel splits attention heads,
the MLP and the vocabulary; expert parallel splits the experts; FSDP splits what is left over
dp_shard x cp (ParallelDims.fsdp_shard; the experts over dp_shard / ep x cp) and HSDP replicates
it over dp_replicate. Context parallelism's own terms are in titanite/plan/context.py.

Per rank, in bytes:
- parameters, gradients: fp32 (the master copy; bf16 is only the compute copy), sharded;
- optimizer: AdamW's two fp32 moments, sharded;
- activations: what one micro-batch keeps for backward, counted tensor by tensor from the
  native model's forward (fused attention and the chunked loss, as on the default kernels;
  the transformers backend is counted the same way, with its logits); with checkpointing, the kept
  block inputs (and, for 'selective', matmul outputs), plus one block recomputed in backward;
- transient: FSDP's gathered copies (the root group, and two blocks: the current one and the
  one prefetched) and one block's unsharded gradients before the reduce-scatter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from titanite.models.qwen3.args import Qwen3Args
from titanite.models.stage import Part
from titanite.parallel.mesh import ParallelDims
from titanite.plan import hybrid

GiB = 2**30


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor as a rank holds it before FSDP: `rows` x `row_elems`."""

    rows: int  # dim 0 after tensor/expert parallel, the dim FSDP shards
    row_elems: int
    expert: bool = False  # FSDP-sharded over dp_shard / ep x cp instead of dp_shard x cp

    @property
    def numel(self) -> int:
        return self.rows * self.row_elems


def layer_tensors(a: Qwen3Args, i: int, tp: int, ep: int) -> list[Tensor]:
    """Block i's parameters: its norms, its token mixer (Qwen3 or gated attention, or Gated
    DeltaNet: titanite/plan/hybrid.py), its MLP (dense, or the router, the experts and a shared
    expert)."""
    H, D = a.hidden_size, a.head_dim
    out = [Tensor(H, 1), Tensor(H, 1)]  # norms (replicated over tp)
    if a.layer_is_linear(i):
        out += [Tensor(rows, n) for rows, n in hybrid.linear_shapes(a)]
    else:
        q = a.num_heads * D * (2 if a.attn_output_gate else 1)  # the output gate doubles q_proj
        out += [Tensor(D, 1), Tensor(D, 1), Tensor(q // tp, H), Tensor(a.num_kv_heads * D // tp, H),
                Tensor(a.num_kv_heads * D // tp, H), Tensor(H, a.num_heads * D // tp)]
    if a.layer_is_moe(i):
        E, Im = a.num_experts, a.moe_intermediate_size
        out += [Tensor(E, H), Tensor(E // ep, 2 * Im * H, expert=True), Tensor(E // ep, H * Im, expert=True)]
        out += [Tensor(rows, n) for rows, n in hybrid.shared_expert_shapes(a)]
    else:
        I = a.intermediate_size
        out += [Tensor(I // tp, H), Tensor(I // tp, H), Tensor(H, I // tp)]
    return out


def top_tensors(a: Qwen3Args, tp: int) -> list[Tensor]:
    vocab = [Tensor(a.vocab_size // tp, a.hidden_size)]
    return vocab + [Tensor(a.hidden_size, 1)] + ([] if a.tie_word_embeddings else vocab)


def uses_fsdp(d: ParallelDims) -> bool:
    """Whether FSDP wraps the model: data-parallel or context-parallel ranks (parallel/fsdp.py)."""
    return d.dp > 1 or d.cp > 1


def sharded(tensors: list[Tensor], d: ParallelDims) -> int:
    """Elements a rank stores after FSDP, which pads dim 0 to a multiple of its degree
    (dp_shard x cp; the experts' dp_shard / ep x cp)."""
    total = 0
    for t in tensors:
        degree = d.dp_shard // d.ep * d.cp if t.expert else d.fsdp_shard
        total += math.ceil(t.rows / degree) * t.row_elems
    return total


def fsdp_transient(d: ParallelDims, a: Qwen3Args, blocks: list[int], top: list[Tensor], grads: list[int],
                   gather_bytes: int) -> float:
    """Bytes of FSDP's gathered copies (the root group when the embeddings are tied, the biggest
    block twice: current and prefetched) in `gather_bytes`, and the biggest block's unsharded fp32
    gradients; `blocks` and `grads`: each block's unsharded elements and gradient elements."""
    if not uses_fsdp(d):
        return 0.0
    root = sum(x.numel for x in top) if a.tie_word_embeddings else 0
    return (root + 2 * max(blocks)) * gather_bytes + max(grads) * 4.0


def layer_activation_elems(a: Qwen3Args, i: int, tp: int, ac: str, sp: bool = True, fp32: float = 1.0) -> float:
    """Values one block keeps for backward, per token of the local micro-batch (fp32 units:
    an int64 counts 2). Sequence-parallel parts (the residual stream and its norms) are /tp; the
    all-gathered norm output feeding attention and the MLP is whole; heads and MLP are /tp.
    `sp`: whether the residual stream is sequence-parallel (native plan) or whole (hf plan).
    `fp32`: an fp32 value in units of the compute dtype (4 / its bytes), for the values a Gated
    DeltaNet block keeps in fp32 whatever the compute dtype (titanite/plan/hybrid.py)."""
    H, D, Hq, Hk = a.hidden_size, a.head_dim, a.num_heads // tp, a.num_kv_heads // tp
    seq = 1 / tp if sp else 1.0  # this rank's share of the residual stream
    if a.layer_is_moe(i):
        k, E, Im = a.num_experts_per_tok, a.num_experts, a.moe_intermediate_size
        # router probs, ids and weights; permuted rows; gate/up, silu, product; un-permuted rows
        mlp_full = E + 9 * k + 1 + k * H + 4 * k * Im + k * H
        mlp_kept = E + 2 * k * Im + k * H  # matmul outputs (router logits, grouped GEMMs)
        mlp_full += hybrid.shared_expert_elems(a, selective=False)
        mlp_kept += hybrid.shared_expert_elems(a, selective=True)
    else:
        I = a.intermediate_size // tp
        mlp_full, mlp_kept = 4 * I, 2 * I + H
    # Per norm: its input (the residual stream), the fp32 rsqrt, the normalised value (all
    # sequence-sharded), and its output as the next matmul saves it (gathered under tp).
    norms = 2 * (seq * (2 * H + 1) + H)
    # q, k, v projections; q/k norm rsqrt and normalised values; RoPE'd q and k; attention
    # output and log-sum-exp.
    attention = 4 * Hq * D + 4 * Hk * D + 2 * Hq + Hk + hybrid.gated_attention_extra(a, tp, selective=False)
    if a.layer_is_linear(i):
        attention = hybrid.linear_mixer_elems(a, fp32)
    if ac == "none":
        return norms + attention + mlp_full
    block_input = seq * H
    if ac == "full":
        return block_input
    assert ac == "selective", ac
    # Matmul and attention outputs: q, k, v, attention (+ lse), o projection (whole sequence:
    # it is kept before the reduce-scatter); the MLP's.
    if a.layer_is_linear(i):
        return block_input + hybrid.linear_mixer_kept(a, fp32) + mlp_kept
    return block_input + 2 * Hq * D + 2 * Hk * D + Hq + H + hybrid.gated_attention_extra(a, tp, True) + mlp_kept


def activation_bytes(a: Qwen3Args, tokens: int, tp: int, ac: str, keeps_logits: bool, value_bytes: int,
                     sp: bool = True, extra: Callable[[int, str], float] | None = None,
                     top_extra: float = 0.0, loss_values: float | None = None,
                     part: Part | None = None) -> tuple[float, float]:
    """(bytes kept for backward at the end of forward, bytes of the one block recomputed in
    backward) for one micro-batch of `tokens` tokens on one rank. `extra(i, mode)` and
    `top_extra`: values per token that block `i` under checkpointing `mode`, and the rest of the
    model, keep on top of (or, negative, below) the full fine-tune's count (LoRA's).
    `loss_values`: what the loss keeps per token, when another objective's loss keeps otherwise
    than the language model's (DPO's, titanite/plan/preference.py). `part`: one pipeline stage's
    share instead of the whole model's (its blocks; the input ids if it is the first, the final
    norm and the loss if it is the last, else its output, which the stage keeps for its backward)."""
    def block(i: int, mode: str) -> float:
        return layer_activation_elems(a, i, tp, mode, sp, 4 / value_bytes) + (extra(i, mode) if extra else 0.0)

    part = part or Part(range(a.num_layers), True, True)
    H = a.hidden_size
    seq = 1 / tp if sp else 1.0
    per_token = sum(block(i, ac) for i in part.layers)
    recompute = 0.0
    if ac != "none":
        recompute = max(block(i, "none") for i in part.layers)
    per_token += 2 * a.rotary_dim + (2 if part.first else 0)  # RoPE cos/sin; input ids (int64)
    if not part.last:
        return (per_token + seq * H) * tokens * value_bytes, recompute * tokens * value_bytes
    # final norm (its input, rsqrt, normalised value) and its gathered output
    per_token += seq * (2 * H + 1) + H + top_extra
    # The loss: the chunked fused loss keeps one fp32 log-sum-exp per token; otherwise the
    # (vocab-sharded) logits and their log-softmax stay alive until backward.
    if loss_values is None:
        loss_values = 2 * a.vocab_size / tp if keeps_logits else 1
    per_token += loss_values
    return per_token * tokens * value_bytes, recompute * tokens * value_bytes

"""LoRA's share of `titanite estimate` (titanite/plan/counts.py and estimator.py count the rest).

A LoRA run (`[lora] enabled`) holds, per rank:
- the frozen base: every base parameter stored in `lora.base_dtype`, sharded as in a full
  fine-tune (TP, FSDP/HSDP and, for the experts, EP), with no gradients and no optimizer state;
- the adapters, fp32: A [r, in] and B [out, r] per adapted dense linear; per adapted MoE experts
  projection one such pair per expert (A [E, r, in], B [E, out, r]). Under tensor parallelism
  (titanite/parallel/lora_tp.py) a column-parallel linear (q/k/v_proj, the dense MLP's gate_proj
  and up_proj) keeps A whole on every tp rank and shards B [out/tp, r]; a row-parallel one
  (o_proj, the dense down_proj) shards A [r, in/tp] and keeps B whole. The experts are not split
  by tp (the MoE block runs whole on each tp rank); their adapters are split over ep on the
  expert dim like the experts. FSDP then shards dim 0 of each tp/ep-local tensor, as the base's.
  They get fp32 gradients and AdamW's two fp32 moments;
- activations: those of the full fine-tune of the layout (the backward still runs through the
  frozen base), less what only the frozen weights' gradients needed (`frozen_elems`: the norms'
  normalised values, the inputs of matmuls without adapters; without checkpointing; each with
  its tp-local shape), plus, per adapted dense linear and token, A's output [r] values (under
  tp too: whole r on the whole sequence, the one a column-parallel linear reads being gathered,
  and a row-parallel one's a partial sum over the ranks); with dropout (refused with tp > 1)
  also A's dropped input [in] and its mask (1 byte: CUDA's bool mask; on CPU torch keeps a
  full-width noise tensor); under 'selective' checkpointing A's and B's outputs (matmul outputs,
  which it keeps) instead: [r + out/tp] for a column-parallel linear, [r + out] (a partial sum,
  before the reduction) for a row-parallel one; under 'full' nothing more (the recomputed block
  counts the 'none' values). MoE expert adapters are applied as effective weights
  W + scale * B @ A, built once per MoE layer in forward (compute dtype: bf16 under
  mixed_precision bf16, else fp32) and kept by autograd for backward: one expert stack (this
  rank's experts, the adapted projections) per MoE layer without checkpointing, or one layer's
  worth, rebuilt in backward, as transient with it.
  Checked against the native model's saved tensors (tests/plan/test_lora_estimate.py);
- transient: FSDP's gathered copies as in a full fine-tune, of the base and the adapters, in the
  compute dtype (FSDP's mixed-precision policy casts before the all-gather); the biggest block's
  unsharded fp32 adapter gradients; and the gradient of one layer's effective expert weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from titanite.core.config import Config, LoraConfig
from titanite.models.flops import lora_flops_per_token
from titanite.models.handle import ActivationProfile
from titanite.models.lora import check_dropout, chosen_targets
from titanite.models.qwen3.args import Qwen3Args
from titanite.models.stage import Part
from titanite.parallel.mesh import ParallelDims
from titanite.plan.counts import (
    Tensor,
    activation_bytes,
    fsdp_transient,
    layer_tensors,
    sharded,
    top_tensors,
    uses_fsdp,
)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
TARGETS = ATTENTION + DENSE_MLP + EXPERTS
# Under tensor parallelism: base weight sharded on its output dim (column-parallel) or its input
# dim (row-parallel); the experts are not split by tp.
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Projection:
    """One projection of one layer that LoRA can adapt: `in_features` -> `out_features`,
    `experts` stacked copies of it (0 for a plain linear)."""

    name: str  # one of TARGETS
    in_features: int
    out_features: int
    experts: int = 0

    def adapter_params(self, r: int) -> int:
        """Adapter elements, all experts: r * (in + out) per copy."""
        return max(self.experts, 1) * r * (self.in_features + self.out_features)

    def local_out(self, tp: int) -> int:
        """B's output features on one tp rank: a column-parallel linear's are split."""
        return self.out_features // tp if self.name in COLWISE else self.out_features


@dataclass(frozen=True)
class LoraParams:
    """What the report says about a LoRA run's parameters."""

    base: int  # frozen base parameters, whole model
    adapters: int  # trainable (adapter) parameters, whole model
    base_bytes: float  # per rank, in lora.base_dtype, sharded
    adapter_bytes: float  # per rank, fp32, sharded
    base_dtype: str
    experts_adapted: bool  # MoE expert projections are targeted (their effective weights count)

    @property
    def total(self) -> int:
        return self.base + self.adapters


def projections(a: Qwen3Args, i: int) -> list[Projection]:
    """Every projection of layer `i` LoRA can adapt, with its whole (unsharded) shape."""
    H, qd, kvd = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    out = [Projection("q_proj", H, qd), Projection("k_proj", H, kvd), Projection("v_proj", H, kvd),
           Projection("o_proj", qd, H)]
    if a.layer_is_moe(i):
        E, Im = a.num_experts, a.moe_intermediate_size
        return out + [Projection("experts.gate_up_proj", H, 2 * Im, E), Projection("experts.down_proj", Im, H, E)]
    I = a.intermediate_size
    return out + [Projection("gate_proj", H, I), Projection("up_proj", H, I), Projection("down_proj", I, H)]


def lora_targets(a: Qwen3Args, lo: LoraConfig) -> set[str]:
    """The target names of `lora.target_modules` on this model, checked as training checks them
    (titanite.models.lora): 'all-linear' is every projection it has (not the head, not the router)."""
    targets = chosen_targets(lo, {p.name for i in range(a.num_layers) for p in projections(a, i)})
    check_dropout(lo, targets)
    return targets


def adapted(a: Qwen3Args, i: int, targets: set[str]) -> list[Projection]:
    """The projections of layer `i` that carry adapters."""
    return [p for p in projections(a, i) if p.name in targets]


def adapter_tensors(p: Projection, r: int, tp: int, ep: int) -> list[Tensor]:
    """A and B of one adapted projection as a rank holds them before FSDP (fp32 elements)."""
    if p.experts:  # per expert [r, in] and [out, r], the expert dim split over ep (not over tp)
        return [Tensor(p.experts // ep, r * p.in_features, expert=True),
                Tensor(p.experts // ep, p.out_features * r, expert=True)]
    if p.name in ROWWISE:  # A Shard(1) [r, in/tp], B replicated [out, r]
        return [Tensor(r, p.in_features // tp), Tensor(p.out_features, r)]
    assert p.name in COLWISE, p.name  # A replicated [r, in], B Shard(0) [out/tp, r]
    return [Tensor(r, p.in_features), Tensor(p.out_features // tp, r)]


def layer_adapter_tensors(a: Qwen3Args, i: int, lo: LoraConfig, targets: set[str], tp: int,
                          ep: int) -> list[Tensor]:
    return [t for p in adapted(a, i, targets) for t in adapter_tensors(p, lo.rank, tp, ep)]


def adapter_params(a: Qwen3Args, lo: LoraConfig, targets: set[str]) -> int:
    """Trainable elements of the whole model (what peft's trainable-parameter count says)."""
    return sum(p.adapter_params(lo.rank) for i in range(a.num_layers) for p in adapted(a, i, targets))


def flops_per_token(a: Qwen3Args, lo: LoraConfig, seq_len: int) -> float:
    """Training FLOPs per token of the LoRA run, as the trainer's MFU counts them
    (titanite.models.flops.lora_flops_per_token)."""
    targets = lora_targets(a, lo)
    linear = sum(p.adapter_params(lo.rank) for i in range(a.num_layers) for p in adapted(a, i, targets)
                 if not p.experts)
    first_qkv = sum(lo.rank * p.in_features for p in adapted(a, 0, targets) if p.name in ("q_proj", "k_proj", "v_proj"))
    experts = any(p.experts for i in range(a.num_layers) for p in adapted(a, i, targets))
    return lora_flops_per_token(a, seq_len, linear, experts, first_qkv)


def activation_elems(a: Qwen3Args, i: int, lo: LoraConfig, targets: set[str], ac: str,
                     value_bytes: int, tp: int = 1, sp: bool = True) -> float:
    """Values (compute dtype) per token that layer `i` keeps for backward in a LoRA run on top
    of the full fine-tune's count (negative where the frozen base keeps less): the dense
    adapters' own values, less `frozen_elems` without checkpointing. Expert adapters keep no
    per-token values of their own (their effective weights: `expert_stack_elems`). `tp`, `sp`:
    as for counts.layer_activation_elems. A's output is [r] on every tp rank for every token
    of the micro-batch (a column-parallel linear reads the gathered sequence; a row-parallel
    one's is a partial sum over the ranks, full r wide), so only B's output and the frozen
    values shrink with tp."""
    dense = [p for p in adapted(a, i, targets) if not p.experts]
    if ac == "full":
        return 0.0
    if ac == "selective":  # A's and B's outputs are matmul outputs; the dropout is recomputed
        return sum(lo.rank + p.local_out(tp) for p in dense)
    assert ac == "none", ac
    # A's output; with dropout (tp == 1 only), per input element A's dropped input and a 1-byte mask
    assert tp == 1 or lo.dropout == 0, "lora.dropout with tp > 1 is refused by the config"
    dropped = sum(p.in_features for p in dense) * (1 + 1 / value_bytes) if lo.dropout > 0 else 0.0
    return len(dense) * lo.rank + dropped - frozen_elems(a, i, lo, targets, tp, sp)


def frozen_elems(a: Qwen3Args, i: int, lo: LoraConfig, targets: set[str], tp: int = 1,
                 sp: bool = True) -> float:
    """Values per token the full fine-tune's block `i` keeps (no checkpointing) only for the
    gradients of weights a LoRA run freezes: the four norms' normalised values (for their
    weights), and each matmul's input unless an adapter (without dropout: with it, the adapter
    keeps its own dropped copy) or the expert weights' gradient needs it. The router's input
    (the MLP norm's output) is never needed, nor the attention output (attention's backward
    keeps it), nor, in block 0, its input and rsqrt (the frozen embedding's output needs no
    gradient). An upper bound still: block 0 keeps less again where its attention adapters
    leave paths out (a k_proj without adapter needs no k_norm values there).
    Under tp, with the shapes of counts.layer_activation_elems: the block norms' values and
    block 0's input are this rank's share of the residual stream (1/tp with `sp`), the q/k
    norms' and the dense down projection's input are split with the heads and the MLP, and the
    attention, MLP and router inputs are the gathered (whole) norm outputs; the MoE block is
    not split by tp."""
    H, D = a.hidden_size, a.head_dim
    qd, kvd = a.num_heads // tp * D, a.num_kv_heads // tp * D
    seq = 1 / tp if sp else 1.0  # this rank's share of the residual stream
    used = targets if lo.dropout == 0 else {t for t in targets if t in EXPERTS}

    def unless(names: tuple[str, ...], elems: float) -> float:
        return 0.0 if used & set(names) else elems

    # the two block norms' and q/k norms' normalised values; the attention input; block 0's input
    out = 2 * seq * H + qd + kvd + unless(("q_proj", "k_proj", "v_proj"), H) + (seq * (H + 1) if i == 0 else 0)
    if a.layer_is_moe(i):  # the router's input; the permuted rows; the down projection's input
        k, Im = a.num_experts_per_tok, a.moe_intermediate_size
        return out + H + unless(("experts.gate_up_proj",), k * H) + unless(("experts.down_proj",), k * Im)
    return out + unless(("gate_proj", "up_proj"), H) + unless(("down_proj",), a.intermediate_size // tp)


def expert_stack_elems(a: Qwen3Args, i: int, targets: set[str], ep: int) -> int:
    """Elements of layer `i`'s effective expert weights W + scale * B @ A (this rank's experts,
    the adapted projections only); 0 on a dense layer or without expert targets."""
    return sum(p.experts // ep * p.in_features * p.out_features for p in adapted(a, i, targets) if p.experts)


def expert_weight_bytes(a: Qwen3Args, targets: set[str], ep: int, ac: str, value_bytes: int,
                        blocks: Sequence[int] | None = None) -> tuple[float, float]:
    """(bytes kept at the end of forward, transient bytes) of the effective expert weights:
    without checkpointing every MoE layer keeps its stack and one gradient of it is transient in
    backward; with checkpointing one layer's stack (rebuilt in backward) and its gradient are.
    `blocks`: the layers counted (default: all)."""
    stacks = [expert_stack_elems(a, i, targets, ep) for i in (range(a.num_layers) if blocks is None else blocks)]
    biggest = max(stacks)
    if ac == "none":
        return sum(stacks) * value_bytes, biggest * value_bytes
    return 0.0, 2 * biggest * value_bytes


def lora_memory(cfg: Config, a: Qwen3Args, d: ParallelDims, layers: list[list[Tensor]], top: list[Tensor],
                tokens: int, profile: ActivationProfile, loss_values: float | None = None,
                blocks: Sequence[int] | None = None, part: Part | None = None) -> tuple[list[float], LoraParams]:
    """([params, grads, optimizer, activations, recompute, transient] bytes per rank of a LoRA
    run, its parameter counts). `layers`, `top`: the base tensors as a rank holds them before
    FSDP; `blocks`: the layers `layers` are (default: all, a pipeline rank's otherwise); `part`:
    the pipeline stage whose activations are counted (default: the whole model). FSDP gathers the
    base and the adapters in the compute dtype (its mixed-precision policy casts before the
    all-gather: bf16 under mixed_precision bf16, else fp32), and only the adapters have unsharded
    gradients. `loss_values`: as counts.activation_bytes takes it."""
    lo, ac = cfg.lora, cfg.parallelism.activation_checkpoint
    targets = lora_targets(a, lo)
    indices = range(a.num_layers) if blocks is None else blocks
    adapters = [layer_adapter_tensors(a, i, lo, targets, d.tp, d.ep) for i in indices]
    base_local = sharded([x for layer in layers for x in layer] + top, d)
    adapter_local = sharded([x for layer in adapters for x in layer], d)
    base_dtype_bytes = 2 if lo.base_dtype == "bf16" else 4
    compute_bytes = 2 if cfg.training.mixed_precision == "bf16" else 4
    whole_base = sum(x.numel for i in range(a.num_layers) for x in layer_tensors(a, i, 1, 1))
    counts = LoraParams(whole_base + sum(x.numel for x in top_tensors(a, 1)), adapter_params(a, lo, targets),
                        base_local * base_dtype_bytes, adapter_local * 4.0, lo.base_dtype,
                        any(name in targets for name in EXPERTS))
    adapter_blocks = [sum(x.numel for x in layer) for layer in adapters]
    blocks = [sum(x.numel for x in layer) + n for layer, n in zip(layers, adapter_blocks)]
    transient = fsdp_transient(d, a, blocks, top, adapter_blocks, compute_bytes)
    sp = profile.sequence_parallel
    kept, recompute = activation_bytes(
        a, tokens, d.tp, ac, profile.keeps_logits, compute_bytes, sp=sp,
        extra=lambda i, mode: activation_elems(a, i, lo, targets, mode, compute_bytes, d.tp, sp),
        # the final norm's normalised value (this rank's share of the sequence): its weight is frozen
        top_extra=-a.hidden_size * (1 / d.tp if sp else 1.0), loss_values=loss_values, part=part)
    expert_kept, expert_transient = expert_weight_bytes(a, targets, d.ep, ac, compute_bytes,
                                                        part.layers if part is not None else indices)
    if not uses_fsdp(d) and compute_bytes == 2:  # autocast's bf16 copies of fp32 weights, saved for backward
        transient += 2.0 * (adapter_local + (base_local if base_dtype_bytes == 4 else 0))
    return [counts.base_bytes + counts.adapter_bytes, adapter_local * 4.0, adapter_local * 8.0,
            kept + expert_kept, recompute, transient + expert_transient], counts

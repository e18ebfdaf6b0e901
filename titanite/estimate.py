"""`titanite estimate`: memory per rank and FLOPs per step for a config's layout, before renting
the machines.

Everything is counted from the architecture (config.json or the flavor) and `[parallelism]`,
with the sharding rules titanite applies (parallel/): tensor parallel splits attention heads,
the MLP and the vocabulary; expert parallel splits the experts; FSDP splits what is left over
dp_shard (the experts over dp_shard / ep) and HSDP replicates it over dp_replicate.

Per rank, in bytes:
- parameters, gradients: fp32 (the master copy; bf16 is only the compute copy), sharded;
- optimizer: AdamW's two fp32 moments, sharded;
- activations: what one micro-batch keeps for backward, counted tensor by tensor from the
  native model's forward (fused attention and the chunked loss, as on the default kernels;
  the transformers backend is counted the same way, with its logits); with checkpointing, the kept
  block inputs (and, for 'selective', matmul outputs), plus one block recomputed in backward;
- transient: FSDP's gathered copies (the root group, and two blocks: the current one and the
  one prefetched) and one block's unsharded gradients before the reduce-scatter.
The peak is their sum; allocator fragmentation and communication buffers come on top.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from titanite.config import Config
from titanite.device import Peak
from titanite.models.flops import flops_per_token
from titanite.models.handle import ActivationProfile
from titanite.models.qwen3.args import Qwen3Args
from titanite.parallel.mesh import ParallelDims

GiB = 2**30


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor as a rank holds it before FSDP: `rows` x `row_elems`."""

    rows: int  # dim 0 after tensor/expert parallel, the dim FSDP shards
    row_elems: int
    expert: bool = False  # FSDP-sharded over dp_shard / ep instead of dp_shard

    @property
    def numel(self) -> int:
        return self.rows * self.row_elems


@dataclass
class Estimate:
    dims: ParallelDims
    params: float
    grads: float
    optimizer: float
    activations: float  # kept at the end of forward
    recompute: float  # one block's activations rebuilt in backward (checkpointing only)
    transient: float
    flops_per_step: float  # per rank, training (forward + backward + recomputation)
    tokens_per_step: int  # global

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.recompute + self.transient


def _layer_tensors(a: Qwen3Args, i: int, tp: int, ep: int) -> list[Tensor]:
    H, D = a.hidden_size, a.head_dim
    out = [Tensor(H, 1), Tensor(H, 1), Tensor(D, 1), Tensor(D, 1),  # norms (replicated over tp)
           Tensor(a.num_heads * D // tp, H), Tensor(a.num_kv_heads * D // tp, H),
           Tensor(a.num_kv_heads * D // tp, H), Tensor(H, a.num_heads * D // tp)]
    if a.layer_is_moe(i):
        E, Im = a.num_experts, a.moe_intermediate_size
        out += [Tensor(E, H), Tensor(E // ep, 2 * Im * H, expert=True), Tensor(E // ep, H * Im, expert=True)]
    else:
        I = a.intermediate_size
        out += [Tensor(I // tp, H), Tensor(I // tp, H), Tensor(H, I // tp)]
    return out


def _top_tensors(a: Qwen3Args, tp: int) -> list[Tensor]:
    vocab = [Tensor(a.vocab_size // tp, a.hidden_size)]
    return vocab + [Tensor(a.hidden_size, 1)] + ([] if a.tie_word_embeddings else vocab)


def _sharded(tensors: list[Tensor], d: ParallelDims) -> int:
    """Elements a rank stores after FSDP, which pads dim 0 to a multiple of its degree."""
    total = 0
    for t in tensors:
        degree = d.dp_shard // d.ep if t.expert else d.dp_shard
        total += math.ceil(t.rows / degree) * t.row_elems
    return total


def layer_activation_elems(a: Qwen3Args, i: int, tp: int, ac: str, sp: bool = True) -> float:
    """Values one block keeps for backward, per token of the local micro-batch (fp32 units:
    an int64 counts 2). Sequence-parallel parts (the residual stream and its norms) are /tp; the
    all-gathered norm output feeding attention and the MLP is whole; heads and MLP are /tp.
    `sp`: whether the residual stream is sequence-parallel (native plan) or whole (hf plan)."""
    H, D, Hq, Hk = a.hidden_size, a.head_dim, a.num_heads // tp, a.num_kv_heads // tp
    seq = 1 / tp if sp else 1.0  # this rank's share of the residual stream
    if a.layer_is_moe(i):
        k, E, Im = a.num_experts_per_tok, a.num_experts, a.moe_intermediate_size
        # router probs, ids and weights; permuted rows; gate/up, silu, product; un-permuted rows
        mlp_full = E + 9 * k + 1 + k * H + 4 * k * Im + k * H
        mlp_kept = E + 2 * k * Im + k * H  # matmul outputs (router logits, grouped GEMMs)
    else:
        I = a.intermediate_size // tp
        mlp_full, mlp_kept = 4 * I, 2 * I + H
    # Per norm: its input (the residual stream), the fp32 rsqrt, the normalised value (all
    # sequence-sharded), and its output as the next matmul saves it (gathered under tp).
    norms = 2 * (seq * (2 * H + 1) + H)
    # q, k, v projections; q/k norm rsqrt and normalised values; RoPE'd q and k; attention
    # output and log-sum-exp.
    attention = 4 * Hq * D + 4 * Hk * D + 2 * Hq + Hk
    if ac == "none":
        return norms + attention + mlp_full
    block_input = seq * H
    if ac == "full":
        return block_input
    assert ac == "selective", ac
    # Matmul and attention outputs: q, k, v, attention (+ lse), o projection (whole sequence:
    # it is kept before the reduce-scatter); the MLP's.
    return block_input + 2 * Hq * D + 2 * Hk * D + Hq + H + mlp_kept


def activation_bytes(a: Qwen3Args, tokens: int, tp: int, ac: str, keeps_logits: bool, value_bytes: int,
                     sp: bool = True) -> tuple[float, float]:
    """(bytes kept for backward at the end of forward, bytes of the one block recomputed in
    backward) for one micro-batch of `tokens` tokens on one rank."""
    H = a.hidden_size
    seq = 1 / tp if sp else 1.0
    per_token = sum(layer_activation_elems(a, i, tp, ac, sp) for i in range(a.num_layers))
    recompute = 0.0
    if ac != "none":
        recompute = max(layer_activation_elems(a, i, tp, "none", sp) for i in range(a.num_layers))
    # final norm (its input, rsqrt, normalised value) and its gathered output; RoPE cos/sin;
    # input ids (int64).
    per_token += seq * (2 * H + 1) + H + 2 * a.head_dim + 2
    # The loss: the chunked fused loss keeps one fp32 log-sum-exp per token; otherwise the
    # (vocab-sharded) logits and their log-softmax stay alive until backward.
    per_token += 2 * a.vocab_size / tp if keeps_logits else 1
    return per_token * tokens * value_bytes, recompute * tokens * value_bytes


def estimate(cfg: Config, world_size: int, args: Qwen3Args | None = None,
             profile: ActivationProfile | None = None) -> Estimate:
    """The estimate for `cfg` on `world_size` ranks. The config's model is built on the meta
    device and its layout checked as training checks it; `args` (another architecture, for
    what-if estimates) and `profile` override what that model says."""
    from titanite.device import pick_device
    from titanite.models.spec import get_spec
    from titanite.preflight import check_layout, choose_loss

    d = ParallelDims.resolve(cfg.parallelism, world_size)
    handle = get_spec(cfg.model.spec).build(cfg.model)
    check_layout(d, handle)
    args = args or handle.args
    if profile is None:
        kernels_cfg = choose_loss(cfg, handle, pick_device(cfg.job.device), quiet=True)
        profile = handle.activation_profile(kernels_cfg, d.tp)
    a, t = args, cfg.training
    layers = [_layer_tensors(a, i, d.tp, d.ep) for i in range(a.num_layers)]
    top = _top_tensors(a, d.tp)
    local = _sharded([x for layer in layers for x in layer] + top, d)
    fsdp = d.dp > 1
    param_bytes = 2 if t.mixed_precision == "bf16" else 4  # the compute copy FSDP gathers
    transient = 0.0
    if fsdp:
        unsharded = [sum(x.numel for x in layer) for layer in layers]
        biggest = max(unsharded)
        root = sum(x.numel for x in top) if a.tie_word_embeddings else 0
        transient = (root + 2 * biggest) * param_bytes + biggest * 4
    tokens = t.batch_size * cfg.data.seq_len
    value_bytes = 2 if t.mixed_precision == "bf16" else 4
    kept, recompute = activation_bytes(a, tokens, d.tp, cfg.parallelism.activation_checkpoint,
                                       profile.keeps_logits, value_bytes, sp=profile.sequence_parallel)
    global_tokens = (t.global_batch_size or t.batch_size * d.dp) * cfg.data.seq_len
    flops = flops_per_token(a, cfg.data.seq_len) * global_tokens / world_size
    if cfg.parallelism.activation_checkpoint == "full":
        flops *= 4 / 3  # one more forward of the blocks (the head is not recomputed; a slight overcount)
    return Estimate(d, local * 4.0, local * 4.0, local * 8.0, kept, recompute, transient, flops, global_tokens)


def report(e: Estimate, cfg: Config, peak: Peak | None = None) -> str:
    d = e.dims
    rows = [("parameters (fp32, sharded)", e.params), ("gradients (fp32, sharded)", e.grads),
            ("optimizer (AdamW, fp32)", e.optimizer),
            (f"activations (micro-batch {cfg.training.batch_size} x {cfg.data.seq_len}, "
             f"checkpointing {cfg.parallelism.activation_checkpoint})", e.activations),
            ("recomputed block (checkpointing)", e.recompute),
            ("transient (FSDP gathers, unsharded grads)", e.transient), ("peak", e.total)]
    width = max(len(r[0]) for r in rows)
    lines = [f"layout: {d.describe()}, mixed precision {cfg.training.mixed_precision}",
             "memory per rank:"]
    lines += [f"  {name:<{width}}  {value / GiB:10.3f} GiB" for name, value in rows]
    lines.append(f"FLOPs per step per rank: {e.flops_per_step:.3e} "
                 f"({e.tokens_per_step} tokens per step over all ranks)")
    if peak is not None:  # the peak the trainer's MFU uses, from the same function
        lines.append(f"device peak for MFU: {peak.describe()}; one step takes at least "
                     f"{e.flops_per_step / peak.flops:.3g} s at that peak, {e.flops_per_step / (0.4 * peak.flops):.3g} s "
                     "at 40% MFU")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titanite estimate",
                                     description="Memory per rank and FLOPs per step for a config's parallel layout.",
                                     epilog="Overrides: --section.key=value, as for train.")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--world-size", type=int, default=0,
                        help="ranks (nodes x processes per node); default: the product of the degrees")
    args, overrides = parser.parse_known_args(argv)
    from titanite.config import load_config

    cfg = load_config(args.config, overrides)
    p = cfg.parallelism
    world = args.world_size or p.dp_replicate * max(p.dp_shard, 1) * p.tp
    import torch

    from titanite.device import peak_flops, pick_device

    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    peak = peak_flops(pick_device(cfg.job.device), dtype, cfg.metrics.peak_tflops)
    print(report(estimate(cfg, world), cfg, peak))
    return 0

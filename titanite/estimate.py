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

These are not all alive at once: the peak is the largest of four moments of a step, counted
by titanite/estimate_phases.py (`Estimate.phases`).
On CPU the trainer hands freed memory back when several ranks share the host
(titanite.device.set_host_memory_policy), so the resident set follows these counts; a single
process keeps freed memory for speed, and its heap holds some fragmentation on top.

A LoRA run (`[lora] enabled`) is counted by titanite/estimate_lora.py: the frozen base in
lora.base_dtype with no gradients or optimizer state, fp32 adapters with both, and the adapters'
own activations and transients on top of the full fine-tune's; its peak is the same phases, with
no vocabulary gradients (the head and the embedding stay frozen).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from titanite import accelerators
from titanite.config import Config, ParallelismConfig
from titanite.device import Peak
from titanite.errors import UserError
from titanite.models.flops import flops_per_token
from titanite.models.handle import ActivationProfile
from titanite.models.qwen3.args import Qwen3Args
from titanite.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    import torch

    from titanite.estimate_lora import LoraParams

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
    lora: LoraParams | None = None  # a LoRA run's parameter counts (params = its base + adapters)
    phases: dict[str, float] = field(default_factory=dict)  # the peak of each moment of a step

    @property
    def total(self) -> float:
        """The peak per rank: the largest phase."""
        return max(self.phases.values())

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer


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
                     sp: bool = True, extra: Callable[[int, str], float] | None = None,
                     top_extra: float = 0.0) -> tuple[float, float]:
    """(bytes kept for backward at the end of forward, bytes of the one block recomputed in
    backward) for one micro-batch of `tokens` tokens on one rank. `extra(i, mode)` and
    `top_extra`: values per token that block `i` under checkpointing `mode`, and the rest of the
    model, keep on top of (or, negative, below) the full fine-tune's count (LoRA's)."""
    def block(i: int, mode: str) -> float:
        return layer_activation_elems(a, i, tp, mode, sp) + (extra(i, mode) if extra else 0.0)

    H = a.hidden_size
    seq = 1 / tp if sp else 1.0
    per_token = sum(block(i, ac) for i in range(a.num_layers))
    recompute = 0.0
    if ac != "none":
        recompute = max(block(i, "none") for i in range(a.num_layers))
    # final norm (its input, rsqrt, normalised value) and its gathered output; RoPE cos/sin;
    # input ids (int64).
    per_token += seq * (2 * H + 1) + H + 2 * a.head_dim + 2 + top_extra
    # The loss: the chunked fused loss keeps one fp32 log-sum-exp per token; otherwise the
    # (vocab-sharded) logits and their log-softmax stay alive until backward.
    per_token += 2 * a.vocab_size / tp if keeps_logits else 1
    return per_token * tokens * value_bytes, recompute * tokens * value_bytes


def estimate(cfg: Config, world_size: int, args: Qwen3Args | None = None,
             profile: ActivationProfile | None = None, on_gloo: bool | None = None,
             gloo_buffers: bool = True) -> Estimate:
    """The estimate for `cfg` on `world_size` ranks. The config's model is built on the meta
    device and its layout checked as training checks it; `args` (another architecture, for
    what-if estimates) and `profile` override what that model says. `on_gloo`: whether the
    collectives run on gloo (CPU training; default: whether job.device resolves to the CPU here);
    `gloo_buffers`: then count the buffers gloo allocates outside torch's allocator too."""
    from titanite.device import is_host, pick_device
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
    tokens = t.batch_size * cfg.data.seq_len
    if cfg.lora.enabled:
        from titanite.estimate_lora import lora_memory

        memory, lora = lora_memory(cfg, a, d, layers, top, tokens, profile)
    else:
        memory, lora = _full_memory(cfg, a, d, layers, top, tokens, profile), None
    global_tokens = (t.global_batch_size or t.batch_size * d.dp) * cfg.data.seq_len
    if cfg.lora.enabled:
        from titanite.estimate_lora import flops_per_token as lora_flops

        per_token = lora_flops(a, cfg.lora, cfg.data.seq_len)
    else:
        per_token = flops_per_token(a, cfg.data.seq_len)
    flops = per_token * global_tokens / world_size
    if cfg.parallelism.activation_checkpoint == "full":
        flops *= 4 / 3  # one more forward of the blocks (the head is not recomputed; a slight overcount)
    if on_gloo is None:
        on_gloo = is_host(pick_device(cfg.job.device))
    from titanite.estimate_phases import step_phases

    block_grads = 0 if cfg.lora.enabled else max(sum(x.numel for x in layer) for layer in layers)  # LoRA's: small

    phases = step_phases(cfg, a, d, top, tokens, profile.keeps_logits, memory, block_grads, on_gloo, gloo_buffers)
    return Estimate(d, *memory, flops, global_tokens, lora=lora, phases=phases)


def fsdp_transient(d: ParallelDims, a: Qwen3Args, blocks: list[int], top: list[Tensor], grads: list[int],
                   gather_bytes: int) -> float:
    """Bytes of FSDP's gathered copies (the root group when the embeddings are tied, the biggest
    block twice: current and prefetched) in `gather_bytes`, and the biggest block's unsharded fp32
    gradients; `blocks` and `grads`: each block's unsharded elements and gradient elements."""
    if d.dp == 1:
        return 0.0
    root = sum(x.numel for x in top) if a.tie_word_embeddings else 0
    return (root + 2 * max(blocks)) * gather_bytes + max(grads) * 4.0


def _full_memory(cfg: Config, a: Qwen3Args, d: ParallelDims, layers: list[list[Tensor]], top: list[Tensor],
                 tokens: int, profile: ActivationProfile) -> list[float]:
    """[params, grads, optimizer, activations, recompute, transient] bytes per rank of a full fine-tune."""
    local = _sharded([x for layer in layers for x in layer] + top, d)
    compute_bytes = 2 if cfg.training.mixed_precision == "bf16" else 4  # the copy FSDP gathers, the values
    unsharded = [sum(x.numel for x in layer) for layer in layers]
    transient = fsdp_transient(d, a, unsharded, top, unsharded, compute_bytes)
    if d.dp == 1 and compute_bytes == 2:  # autocast's bf16 copies of the weights, kept for backward
        transient += 2.0 * local
    kept, recompute = activation_bytes(a, tokens, d.tp, cfg.parallelism.activation_checkpoint,
                                       profile.keeps_logits, compute_bytes, sp=profile.sequence_parallel)
    return [local * 4.0, local * 4.0, local * 8.0, kept, recompute, transient]


def _state_rows(e: Estimate) -> list[tuple[str, float]]:
    """The parameter, gradient and optimizer rows (bytes per rank)."""
    if e.lora is None:
        return [("parameters (fp32, sharded)", e.params), ("gradients (fp32, sharded)", e.grads),
                ("optimizer (AdamW, fp32)", e.optimizer)]
    return [(f"parameters: frozen base ({e.lora.base_dtype}, sharded)", e.lora.base_bytes),
            ("parameters: adapters (fp32, sharded)", e.lora.adapter_bytes),
            ("gradients (adapters only, fp32, sharded)", e.grads),
            ("optimizer (AdamW, adapters only, fp32)", e.optimizer)]


def _lora_line(e: Estimate, cfg: Config) -> list[str]:
    """The LoRA run's parameter counts (none for a full fine-tune)."""
    if e.lora is None:
        return []
    n, lo = e.lora, cfg.lora
    return [f"LoRA rank {lo.rank}, alpha {lo.alpha:g}, targets {', '.join(lo.target_modules)}: "
            f"{n.adapters:,} trainable parameters (adapters) of {n.total:,} total "
            f"({n.base:,} frozen base; {100 * n.adapters / n.total:.3g}% trainable)"]


def report(e: Estimate, cfg: Config, peak: Peak | str | None = None) -> str:
    """The estimate as printed; `peak`: the device peak for MFU, or a line saying why none is known."""
    d = e.dims
    transient = "FSDP gathers, unsharded grads"
    if e.lora is not None:
        experts = ", effective expert weights" if e.lora.experts_adapted else ""
        transient = f"FSDP gathers, unsharded adapter grads{experts}"
    rows = _state_rows(e) + [
        (f"activations (micro-batch {cfg.training.batch_size} x {cfg.data.seq_len}, "
         f"checkpointing {cfg.parallelism.activation_checkpoint})", e.activations),
        ("recomputed block (checkpointing)", e.recompute), (f"transient ({transient})", e.transient)]
    rows += [(f"at {name}", value) for name, value in e.phases.items()]
    rows.append(("peak (the largest phase)", e.total))
    width = max(len(r[0]) for r in rows)
    lines = [f"layout: {d.describe()}, mixed precision {cfg.training.mixed_precision}"]
    lines += _lora_line(e, cfg) + ["memory per rank:"]
    lines += [f"  {name:<{width}}  {value / GiB:10.3f} GiB" for name, value in rows]
    lines.append(f"FLOPs per step per rank: {e.flops_per_step:.3e} "
                 f"({e.tokens_per_step} tokens per step over all ranks)")
    if isinstance(peak, str):
        lines.append(f"device peak for MFU: {peak}")
    elif peak is not None:  # the peak the trainer's MFU uses, from the same table or measurement
        lines.append(f"device peak for MFU: {peak.describe()}; one step takes at least "
                     f"{e.flops_per_step / peak.flops:.3g} s at that peak, {e.flops_per_step / (0.4 * peak.flops):.3g} s "
                     "at 40% MFU")
    return "\n".join(lines)


def smallest_world(p: ParallelismConfig) -> int:
    """The fewest ranks `[parallelism]` lays out on: dp_replicate x dp_shard x tp, where
    dp_shard = -1 (the rest of the world) takes the fewest ranks that expert parallelism can
    borrow from it: ep. (A fixed dp_shard that ep does not divide fits no world;
    ParallelDims.resolve says so.)"""
    return p.dp_replicate * (p.dp_shard if p.dp_shard > 0 else p.ep) * p.tp


def _named_accelerator(args: argparse.Namespace) -> accelerators.Accelerator | None:
    """--device-name's table entry; it implies --plan-for accelerator and, unless given,
    --device-memory-gib."""
    if not args.device_name:
        return None
    acc = accelerators.lookup(args.device_name)
    if acc is None:
        raise UserError(f"--device-name '{args.device_name}' is not a known accelerator; known: "
                        f"{', '.join(accelerators.names())} (for another, pass --plan-for accelerator, "
                        "--metrics.peak_tflops=T and --device-memory-gib G)")
    if args.plan_for not in ("auto", "accelerator"):
        raise UserError(f"--device-name '{args.device_name}' plans for an accelerator, but --plan-for is 'cpu'")
    args.plan_for = "accelerator"
    args.device_memory_gib = args.device_memory_gib or acc.memory_gib
    return acc


def _planned_peak(cfg: Config, plan_for: str, acc: accelerators.Accelerator | None,
                  dtype: torch.dtype) -> Peak | str:
    """The device peak for MFU on the machines planned for, or why none is known. Planning for
    this machine: the peak training takes here. For an accelerator: metrics.peak_tflops, else the
    named accelerator's (never this machine's)."""
    from titanite.device import peak_flops, pick_device

    if plan_for != "accelerator":
        return peak_flops(pick_device(cfg.job.device), dtype, cfg.metrics.peak_tflops)
    if cfg.metrics.peak_tflops > 0:
        return Peak(cfg.metrics.peak_tflops * 1e12, "metrics.peak_tflops")
    tflops = acc.peak_tflops(dtype) if acc is not None else None
    if tflops is not None:
        return Peak(tflops * 1e12, acc.peak_source(dtype))
    if acc is None:
        return "unknown (no accelerator named); pass --device-name NAME or set metrics.peak_tflops"
    return f"unknown (no {str(dtype).removeprefix('torch.')} peak for {acc.name}); set metrics.peak_tflops"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titanite estimate",
                                     description="Memory per rank and FLOPs per step for a config's parallel layout.",
                                     epilog="Overrides: --section.key=value, as for train.")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--world-size", type=int, default=0,
                        help="ranks (nodes x processes per node); default: the smallest world the layout "
                             "allows (dp_replicate x dp_shard x tp, with dp_shard = -1 taking ep ranks)")
    parser.add_argument("--rehearse", action="store_true",
                        help="also apply the real parallel plan to the real model on the meta device under a "
                             "fake process group of --world-size ranks and report each rank's shards")
    parser.add_argument("--device-memory-gib", type=float, default=0.0,
                        help="with --rehearse: the memory of one device; a layout that does not fit is named "
                             "with one that would; default with --device-name: that accelerator's")
    parser.add_argument("--plan-for", choices=("auto", "cpu", "accelerator"), default="auto",
                        help="the machines the layout is for: 'accelerator' leaves out the CPU collectives' "
                             "(gloo's) buffers when planning GPU runs on a machine without one; default: "
                             "job.device as resolved here")
    parser.add_argument("--device-name", default="",
                        help="the accelerator planned for, which implies --plan-for accelerator: its dense peak "
                             "for MFU (unless metrics.peak_tflops is set) and its memory (unless "
                             f"--device-memory-gib is given); one of {', '.join(accelerators.names())}")
    args, overrides = parser.parse_known_args(argv)
    acc = _named_accelerator(args)
    from titanite.config import load_config

    cfg = load_config(args.config, overrides)
    world = args.world_size or smallest_world(cfg.parallelism)
    if not args.world_size:
        print(f"world size: {world} (the smallest the layout allows; pass --world-size to choose)")
    import torch

    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    peak = _planned_peak(cfg, args.plan_for, acc, dtype)
    on_gloo = {"auto": None, "cpu": True, "accelerator": False}[args.plan_for]
    e = estimate(cfg, world, on_gloo=on_gloo)
    print(report(e, cfg, peak))
    if args.rehearse:
        from titanite import rehearse

        figures = rehearse.rehearse(cfg, world)
        print(rehearse.report(figures, args.device_memory_gib or None))
        f = max(figures, key=lambda x: x.states)
        print(f"  rehearsal / estimate: parameters {f.params / e.params:.3f}, gradients "
              f"{f.grads / max(e.grads, 1):.3f}, optimizer {f.optimizer / max(e.optimizer, 1):.3f}")
        if args.device_memory_gib:
            train_peak = e.total - e.states + f.states  # the phases, with the rehearsal's own states
            if train_peak / GiB > args.device_memory_gib:
                better = rehearse.fitting_layout(cfg, world, args.device_memory_gib, on_gloo)
                print(f"  training peak {train_peak / GiB:.1f} GiB does not fit {args.device_memory_gib:g} GiB; "
                      + (f"this layout would: {better}" if better else f"no layout of {world} ranks would"))
            else:
                print(f"  training peak {train_peak / GiB:.1f} GiB fits {args.device_memory_gib:g} GiB")
    return 0

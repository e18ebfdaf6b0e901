"""Pipeline parallelism's share of `titanite estimate` (`parallelism.pp` > 1); titanite/plan/counts.py
and phases.py count the parts, this module which of them each pipeline rank holds.

The layout is the one training runs (titanite/parallel/pipeline_layout.py, as preflight resolves
it): the blocks split into stages, each pipeline rank r running v of them (1: GPipe, 1F1B; the
looped schedules: stages r, r + pp, ..., 2 unless parallelism.pp_stages_per_rank says more;
ZBVZeroBubble and DualPipeV: stages r and 2 pp - 1 - r), n micro-batches per pass. Per pipeline
rank, in bytes:
- parameters, gradients, optimizer state: those of its stages' blocks, with the embedding where
  it runs the first stage and the final norm and the head where it runs the last, FSDP-sharded
  over its dp_shard x cp ranks as without pipelining (counts.sharded);
- activations: F_r x A_r. A_s is what one micro-batch keeps on stage s (counts.activation_bytes
  for its blocks; the input ids on the first stage, the final norm and the loss on the last; on
  every other stage its output, which the pipeline stage holds until that micro-batch's backward);
  A_r the largest A_s of the rank's stages. F_r is the most micro-batch-stages the schedule keeps
  alive on rank r at once: a micro-batch's activations on a stage live from its forward to the
  backward that frees them; with the backward split into input and weight gradients (the zero-bubble
  schedules) until the weight gradients, which need most of them; where a forward runs overlapped
  with a backward (DualPipeV), both micro-batches count. With m = n / max(1, n // pp)
  micro-batches per round (torch's looped schedules):
    GPipe                  n                              (every forward before any backward)
    1F1B                   min(n, pp - r)                 (pp - r warm-up forwards, then one forward per backward)
    LoopedBFS              v n                            (every forward of every stage first)
    Interleaved1F1B        min(v n, (v - 1) m + 2 (pp - 1 - r) + 1)   (its warm-up forwards, then one more)
    InterleavedZeroBubble  min(v n, (v - 1) m + pp)       (weight gradients deferred r steps on rank r)
    ZBVZeroBubble          min(2 pp, n + r + 1)
    DualPipeV              min(2 n, 2 pp + 1)             (2 pp after its warm-up, one more overlapped)
  (tests/plan/test_plan_pipeline.py holds each to the order torch's schedule builds). With one stage per
  rank it is exact; with more it is an upper bound where the rank's stages keep different amounts
  (the first and the last stage's ends). One block is rebuilt at a time under checkpointing, as
  without pipelining;
- the step's moments (phases.py), with the loss and the head's gradients only on the rank that
  runs the last stage and the embedding's only on the one that runs the first; the gradients the
  pass's earlier micro-batches left are there in both backward moments;
- under context parallelism, the gathered keys and values of the rank's blocks (kept for each
  micro-batch-stage in flight without checkpointing) and their communication;
- a LoRA run (titanite/plan/lora.py): the frozen base and the adapters of the rank's blocks, and
  what each stage's micro-batch keeps (the effective expert weights included) for each in flight.
The estimate's figures are the most loaded pipeline rank's (the largest peak); `PipelineShare`
holds every rank's.

Time and traffic:
- FLOPs per rank: the step's, shared by the stages in proportion to their FLOPs per token (their
  blocks', and the head's on the last), so a rank's is its stages' share x pp x the average;
- the bubble: the share of a step each rank idles in warm-up and drain, layout.bubble();
- point to point, per stage boundary and micro-batch: the hidden states [B, S / cp / (tp if the
  residual stream is sequence-parallel), H] in the compute dtype forward, their gradient of the
  same size backward; boundaries between two stages of one rank (the V's turn on rank pp - 1)
  move nothing. A trained MoE balancing loss adds a forward-only counting pass of every
  micro-batch (titanite/run/lm_step_pipelined.py): a third more FLOPs and the forward sends once more.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanite.core.config import Config
from titanite.models.flops import flops_per_token, head_flops, layer_flops
from titanite.models.handle import ActivationProfile
from titanite.models.qwen3.args import Qwen3Args
from titanite.models.stage import Part
from titanite.parallel.mesh import ParallelDims
from titanite.parallel.pipeline_layout import PipelineLayout
from titanite.plan.context import ContextShare, add_context
from titanite.plan.counts import GiB, activation_bytes, fsdp_transient, layer_tensors, sharded, top_tensors, uses_fsdp
from titanite.plan.lora import LoraParams, lora_memory
from titanite.plan.phases import accumulation_steps, step_phases


def in_flight(layout: PipelineLayout, rank: int) -> int:
    """The most micro-batch-stages pipeline rank `rank` keeps activations for at once (the module
    docstring's F_r)."""
    pp, n, v = layout.pp, layout.microbatches, layout.stages_per_rank
    m = n // max(1, n // pp)  # micro-batches per round of torch's looped schedules
    table = {
        "GPipe": n,
        "1F1B": min(n, pp - rank),
        "LoopedBFS": v * n,
        "Interleaved1F1B": min(v * n, (v - 1) * m + 2 * (pp - 1 - rank) + 1),
        "InterleavedZeroBubble": min(v * n, (v - 1) * m + pp),
        "ZBVZeroBubble": min(2 * pp, n + rank + 1),
        "DualPipeV": min(2 * n, 2 * pp + 1),
    }
    return table[layout.schedule.name]


def counting_pass(a: Qwen3Args) -> bool:
    """Whether a pipelined step runs a forward-only counting pass first: a trained MoE balancing
    loss (titanite/run/lm_step_pipelined.py), whatever model.aux_loss_scope."""
    return bool(a.num_experts and a.output_router_logits)


@dataclass(frozen=True)
class RankShare:
    """What one pipeline rank holds and does (bytes, FLOPs)."""

    pp_rank: int
    parts: tuple[Part, ...]  # its stages, in order
    stages: tuple[int, ...]
    in_flight: int  # micro-batch-stages kept at once (F_r)
    memory: tuple[float, ...]  # params, grads, optimizer, activations (all in flight), recompute, transient
    phases: dict[str, float]
    flops_per_step: float
    p2p_bytes: float  # sent per step (as much is received)
    context: ContextShare | None = None
    lora: LoraParams | None = None  # a LoRA run's counts, its bytes those of this rank's blocks

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def layers(self) -> int:
        return sum(len(p.layers) for p in self.parts)

    @property
    def states(self) -> float:
        return sum(self.memory[:3])

    def describe(self) -> str:
        def blocks(r: range) -> str:
            return f"layers {r.start}-{r.stop - 1}" if len(r) > 1 else f"layer {r.start}"

        spans = ", ".join(f"{k} ({blocks(p.layers)}{', embedding' if p.first else ''}"
                          f"{', norm + head' if p.last else ''})" for k, p in zip(self.stages, self.parts))
        return f"pp rank {self.pp_rank}: stage{'s' if len(self.parts) > 1 else ''} {spans}"


@dataclass(frozen=True)
class PipelineShare:
    """The layout and every pipeline rank's share."""

    layout: PipelineLayout
    ranks: tuple[RankShare, ...]
    passes: int  # pipeline passes per optimizer step
    boundary: float  # bytes of one micro-batch's hidden states across one stage boundary, one way
    counting: bool  # a forward-only counting pass runs first (a trained MoE balancing loss)

    @property
    def worst(self) -> RankShare:
        """The most loaded pipeline rank: the largest peak (the first of equals)."""
        return max(self.ranks, key=lambda r: r.peak)

    def describe(self) -> list[str]:
        """The report's lines: the layout, the bubble, each rank's peak, the point-to-point traffic."""
        lay, w = self.layout, self.worst
        lines = [f"pipeline: {lay.describe()}, {self.passes} pass{'es' if self.passes > 1 else ''} per step"
                 + (" (after a forward-only counting pass: the MoE balancing loss)" if self.counting else ""),
                 f"  bubble {100 * lay.bubble():.1f}% of each step, in theory ((pp - 1) / v stage-slots of warm-up "
                 "and drain" + (", a third of them idle under a zero-bubble schedule" if lay.schedule.split_backward
                                else "") + f", beside {lay.microbatches} micro-batches)"]
        for r in self.ranks if len(self.ranks) <= 8 else sorted({self.ranks[0], w, self.ranks[-1]},
                                                                 key=lambda x: x.pp_rank):
            lines.append(f"  {r.describe()}: {r.in_flight} micro-batch-stage{'s' if r.in_flight > 1 else ''} in "
                         f"flight, states {r.states / GiB:.2f} GiB, peak {r.peak / GiB:.2f} GiB"
                         + (" (the most loaded)" if r is w else ""))
        busiest = max(self.ranks, key=lambda r: r.p2p_bytes)
        lines.append(f"  point to point: {_size(self.boundary)} per micro-batch and stage boundary each way (hidden "
                     f"states forward, their gradients backward); {_size(busiest.p2p_bytes)} sent (and as much "
                     f"received) per step by the busiest rank (pp rank {busiest.pp_rank})")
        return lines


def _size(n: float) -> str:
    return f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


def rank_parts(layout: PipelineLayout, pp_rank: int) -> list[Part]:
    """The parts pipeline rank `pp_rank` runs, as parallelize(..., parts) takes them."""
    return [Part(s.layers, s.first, s.last) for s in layout.rank_spans(pp_rank)]


def pipeline_share(cfg: Config, a: Qwen3Args, d: ParallelDims, layout: PipelineLayout, tokens: int,
                   profile: ActivationProfile, on_gloo: bool, gloo_buffers: bool, flops_per_rank: float,
                   context: ContextShare | None) -> PipelineShare:
    """Every pipeline rank's share. `tokens`: a rank's tokens of one micro-batch; `flops_per_rank`:
    the step's FLOPs over all ranks / the world size; `context`: the whole model's CP terms (None
    without context parallelism)."""
    c = 2 if cfg.training.mixed_precision == "bf16" else 4
    sp = profile.sequence_parallel and d.tp > 1
    boundary = float(tokens * a.hidden_size * c) / (d.tp if sp else 1)
    accum = accumulation_steps(cfg, d)
    counting = counting_pass(a)
    owner = {k: r for r in range(layout.pp) for k in layout.stages_of(r)}
    ranks = []
    for r in range(layout.pp):
        parts = rank_parts(layout, r)
        stages = tuple(layout.stages_of(r))
        f = in_flight(layout, r)
        memory, phases, lora = _rank_memory(cfg, a, d, parts, f, tokens, profile, c, on_gloo, gloo_buffers)
        share = (sum(layer_flops(a, i, cfg.data.seq_len) for p in parts for i in p.layers)
                 + (head_flops(a) if any(p.last for p in parts) else 0.0)) / flops_per_token(a, cfg.data.seq_len)
        # per micro-batch: one forward send past each boundary it ends, one gradient back past each it starts
        forward = sum(1 for k, p in zip(stages, parts) if not p.last and owner[k + 1] != r)
        backward = sum(1 for k, p in zip(stages, parts) if not p.first and owner[k - 1] != r)
        sends = accum * (forward * (2 if counting else 1) + backward)
        cp = _rank_context(context, a, parts, f)
        ranks.append(RankShare(r, tuple(parts), stages, f, tuple(memory), add_context(phases, cp),
                               share * layout.pp * flops_per_rank, sends * boundary, cp, lora))
    return PipelineShare(layout, tuple(ranks), accum // layout.microbatches, boundary, counting)


def _rank_memory(cfg: Config, a: Qwen3Args, d: ParallelDims, parts: list[Part], in_flight: int, tokens: int,
                 profile: ActivationProfile, c: int, on_gloo: bool, gloo_buffers: bool
                 ) -> tuple[list[float], dict[str, float], LoraParams | None]:
    """[params, grads, optimizer, activations, recompute, transient] of one pipeline rank, its
    step's moments and (LoRA) its parameter counts."""
    first, last = any(p.first for p in parts), any(p.last for p in parts)
    indices = [i for p in parts for i in p.layers]
    blocks = [layer_tensors(a, i, d.tp, d.ep) for i in indices]
    embedding, norm, head = top_tensors(a, d.tp)  # untied: pipeline parallelism refuses tied embeddings
    top = ([embedding] if first else []) + ([norm, head] if last else [])
    ac, lora = cfg.parallelism.activation_checkpoint, None
    if cfg.lora.enabled:
        memory, lora = lora_memory(cfg, a, d, blocks, top, tokens, profile, blocks=indices)
        per_stage = [lora_memory(cfg, a, d, [layer_tensors(a, i, d.tp, d.ep) for i in p.layers], top, tokens, profile,
                                 blocks=p.layers, part=p)[0][3:5] for p in parts]
        block_grads = 0  # the adapters': small
    else:
        local = sharded([x for b in blocks for x in b] + top, d)
        unsharded = [sum(x.numel for x in b) for b in blocks]
        transient = fsdp_transient(d, a, unsharded, top, unsharded, c)
        if not uses_fsdp(d) and c == 2:  # autocast's bf16 copies of the weights, kept for backward
            transient += 2.0 * local
        memory = [local * 4.0, local * 4.0, local * 8.0, 0.0, 0.0, transient]
        per_stage = [activation_bytes(a, tokens, d.tp, ac, profile.keeps_logits, c, sp=profile.sequence_parallel,
                                      part=p) for p in parts]
        block_grads = max(unsharded)
    memory[3] = in_flight * max(k for k, _ in per_stage)
    memory[4] = max(r for _, r in per_stage)
    phases = step_phases(cfg, a, d, [embedding, norm, head], tokens, profile.keeps_logits, memory, block_grads,
                         on_gloo, gloo_buffers, first=first, last=last, pipelined=True)
    return memory, phases, lora


def _rank_context(share: ContextShare | None, a: Qwen3Args, parts: list[Part], in_flight: int
                  ) -> ContextShare | None:
    """The CP terms of one pipeline rank's blocks: each micro-batch-stage in flight keeps its
    blocks' gathered keys and values (without checkpointing); the traffic is its blocks'."""
    if share is None:
        return None
    layers = sum(len(p.layers) for p in parts)
    kept = in_flight * max(len(p.layers) for p in parts) * share.kv_layer if share.kept else 0.0
    return dataclasses.replace(share, kept=kept, communication=share.communication * layers / a.num_layers,
                               layers=layers)

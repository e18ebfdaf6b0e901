"""Context parallelism's share of `titanite estimate` (`parallelism.cp` > 1); titanite/plan/counts.py,
estimator.py and phases.py count the rest.

Under context parallelism every sequence of S tokens is cut into 2 cp chunks of c = S / (2 cp),
and cp rank r holds chunks r and 2cp-1-r (titanite/kernels/context_parallel.py). So, per rank:
- every per-token activation the rest of the plan counts is for S / cp tokens of each sequence
  (the estimator passes that rank's share of the micro-batch to counts.activation_bytes and the
  loss's terms; sequence parallelism divides by tp on top where it already does);
- every attention layer all-gathers the keys and values of the whole sequence: [B, Hk/tp, S, D]
  each, in the compute dtype. Without checkpointing every layer keeps its gathered pair for
  backward; under 'full' or 'selective' checkpointing (the gather is neither a matmul nor
  attention, so 'selective' recomputes it too) one layer's pair exists at a time, rebuilt in
  backward beside the recomputed block. In backward their gradients, the same size, are
  reduce-scattered back to the ranks' chunks: one layer's at a time;
- the attention of a query chunk over the keys before its end takes a mask, additive (0 or -inf)
  in the compute dtype, built once per micro-batch and shared by every layer
  (titanite/kernels/torch_impls.py, `_shared_mask`): rank r's chunks end at (r + 1) c and
  (2cp - r) c, so its two masks hold c x (2cp + 1) c values, per row of the micro-batch when
  samples are packed as documents (the mask follows each row's documents), once for all rows
  otherwise (plain causal) on an accelerator; on the host CPU plain rows take no mask (the
  chunk's two blocks are flash calls merged by their log-sum-exps). The kernels' cache keeps it
  past the step's backward, so it is counted in every moment of the step;
- parameters, gradients and optimizer state are FSDP-sharded over dp_shard x cp
  (ParallelDims.fsdp_shard; counts.sharded), and the loss and its token count are reduced over
  dp x cp; the global batch is still batch_size x seq_len x dp per micro-batch step (cp does not
  multiply it), and the FLOPs per rank are the step's over all ranks (the zigzag split gives
  every rank the same share of the causal attention).
Communication, per rank and optimizer step (what the report names): per layer and micro-batch the
forward's all-gather of K and V receives (cp - 1) / cp of the gathered pair, activation
checkpointing gathers again in the recomputation, and backward reduce-scatters their gradients
(the same bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from titanite.core.config import Config
from titanite.core.errors import UserError
from titanite.data.packing import packing_mode
from titanite.models.qwen3.args import Qwen3Args
from titanite.parallel.mesh import ParallelDims
from titanite.plan.counts import GiB


@dataclass(frozen=True)
class ContextShare:
    """What the estimate counted for context parallelism (bytes per rank)."""

    cp: int
    local_tokens: int  # of each sequence, on this rank: S / cp
    kv_layer: float  # one layer's gathered keys and values
    kept: float  # gathered K/V kept at the end of forward (every layer's, without checkpointing)
    recompute: float  # one layer's gathered K/V rebuilt in backward (under checkpointing)
    gradients: float  # one layer's K/V gradients before their reduce-scatter (transient in backward)
    mask: float  # the additive attention mask shared by every layer
    communication: float  # bytes one rank receives per optimizer step (gathers and reduce-scatters)
    collectives: int  # per layer and micro-batch: forward gather, recomputed gather, backward reduce-scatter
    micro_batches: int
    layers: int

    def rows(self) -> list[tuple[str, float]]:
        """The report's memory rows."""
        out = []
        if self.kept:
            out.append((f"CP: gathered keys/values ({self.layers} layers, kept)", self.kept))
        if self.recompute:
            out.append(("CP: gathered keys/values (one layer, rebuilt)", self.recompute))
        return out + [("CP: their gradients (one layer, transient)", self.gradients),
                      ("CP: attention mask (shared by the layers)", self.mask)]

    def describe(self, seq_len: int) -> str:
        """The report's line on the split and the CP communication per step."""
        kinds = ["forward all-gather"] + (["recomputed all-gather"] if self.collectives == 3 else []) \
            + ["backward reduce-scatter"]
        return (f"context parallel: cp = {self.cp}, each rank holds {self.local_tokens} of every sequence's "
                f"{seq_len} tokens (chunks r and {2 * self.cp - 1}-r of {2 * self.cp}); CP communication per "
                f"step per rank: {self.communication / GiB:.3f} GiB ({self.communication:.3e} bytes) received: "
                f"keys and values, {self.layers} layers x {self.micro_batches} micro-batch"
                f"{'es' if self.micro_batches > 1 else ''} x ({' + '.join(kinds)})")


def check_seq_len(cfg: Config, d: ParallelDims) -> None:
    """data.seq_len must cut into 2 cp equal chunks (x tp, for sequence parallelism)."""
    unit = 2 * d.cp * d.tp
    if d.cp > 1 and cfg.data.seq_len % unit:
        raise UserError(f"config key 'data.seq_len' ({cfg.data.seq_len}) must be a multiple of 2 x parallelism.cp"
                        f"{' x tp' if d.tp > 1 else ''} = {unit}")


def local_tokens(cfg: Config, d: ParallelDims, sequences: int) -> int:
    """This rank's tokens of one micro-batch of `sequences` sequences: S / cp of each."""
    check_seq_len(cfg, d)
    return sequences * (cfg.data.seq_len // d.cp)


def context_share(cfg: Config, a: Qwen3Args, d: ParallelDims, sequences: int,
                  micro_batches: int, host: bool = False) -> ContextShare | None:
    """The CP terms for a micro-batch of `sequences` sequences, `micro_batches` per optimizer
    step; None without context parallelism (cp = 1: causal attention runs mask-free)."""
    if d.cp == 1:
        return None
    S, cp, c_bytes = cfg.data.seq_len, d.cp, 2 if cfg.training.mixed_precision == "bf16" else 4
    kv_layer = 2.0 * sequences * (a.num_kv_heads // d.tp) * S * a.head_dim * c_bytes
    checkpointed = cfg.parallelism.activation_checkpoint != "none"
    chunk = S // (2 * cp)
    documents = packing_mode(cfg.data) == "documents"
    rows = sequences if documents else 1
    # one value per query/key pair; plain rows on the host CPU take no mask (two flash calls merged)
    mask = 0.0 if host and not documents else float(rows * chunk * (2 * cp + 1) * chunk * c_bytes)
    collectives = 3 if checkpointed else 2
    communication = kv_layer * (cp - 1) / cp * collectives * a.num_layers * micro_batches
    return ContextShare(cp, S // cp, kv_layer, 0.0 if checkpointed else a.num_layers * kv_layer,
                        kv_layer if checkpointed else 0.0, kv_layer, mask, communication, collectives,
                        micro_batches, a.num_layers)


def add_context(phases: dict[str, float], share: ContextShare | None) -> dict[str, float]:
    """The step's moments with the CP buffers: the kept K/V and the mask in both backward moments,
    with one layer's rebuilt K/V and their gradients in the blocks' backward; the mask (held by
    the kernels' cache) in every moment."""
    if share is None:
        return phases
    out = {name: value + share.mask for name, value in phases.items()}
    for name in ("loss backward", "blocks' backward"):
        if name in out:
            out[name] += share.kept
    if "blocks' backward" in out:
        out["blocks' backward"] += share.recompute + share.gradients
    return out

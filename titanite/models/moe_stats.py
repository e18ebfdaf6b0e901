"""MoE routing telemetry and the auxiliary load-balancing loss, shared by both backends.

Each MoE layer's forward leaves a `RoutingRecord`; the backend turns the records into the
auxiliary loss (transformers' `load_balancing_loss_func` math) and the expert-load stats logged
to metrics.jsonl. Both backends record it from their `moe.router` call (the transformers
backend's router runs the op too, see kernels/hf.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch



@dataclass
class RoutingRecord:
    """What one MoE layer's last forward leaves for the auxiliary loss and the load telemetry."""

    counts: torch.Tensor  # [E] int64 rows routed to each expert (no grad)
    prob_sum: torch.Tensor  # [E] fp32 router probability summed over tokens (carries grad)
    num_tokens: int


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids: [T, k] int64 -> rows per expert, int64 [E]. Sort + searchsorted: deterministic,
    no atomics and no host sync on any device."""
    sorted_ids = torch.sort(topk_ids.flatten()).values
    bounds = torch.arange(1, num_experts + 1, device=topk_ids.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, bounds)
    return torch.diff(ends, prepend=ends.new_zeros(1))


def load_balancing_loss(records: list[RoutingRecord], num_experts: int) -> torch.Tensor:
    """Switch-style auxiliary loss pooled over all MoE layers, as transformers pools it:
    E * sum_e f_e * P_e with f_e = rows routed to e / (tokens x layers) and P_e = summed router
    probability of e / (tokens x layers). Equals k at perfect balance. fp32 scalar; the gradient
    flows through the probabilities only."""
    rows = sum(r.num_tokens for r in records)
    f = torch.stack([r.counts for r in records]).sum(0).float() / rows
    p = torch.stack([r.prob_sum for r in records]).sum(0) / rows
    return num_experts * (f * p).sum()


def routing_stats(layers: list[tuple[int, RoutingRecord]], balance_loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Expert-load telemetry for metrics.jsonl, as 0-dim device tensors (no host sync: the
    trainer reads them with the rest of a logged step).

    Per layer i: `moe/layer{i}/max_over_mean`, the busiest expert's rows over the mean rows per
    expert (1 is perfect balance; E/k means all tokens went to the same k experts), and
    `moe/layer{i}/idle_experts`, experts that got no token. Aggregates: `moe/max_over_mean` (the
    worst layer), `moe/idle_experts` (summed over layers) and `moe/load_balance_loss`, the
    unscaled auxiliary loss (k at perfect balance), logged whether or not it is trained on.
    """
    counts = torch.stack([r.counts for _, r in layers]).float()  # [L, E]
    max_over_mean = counts.amax(1) / counts.mean(1)  # [L]
    idle = (counts == 0).sum(1).float()  # [L]
    stats = {"moe/max_over_mean": max_over_mean.max(), "moe/idle_experts": idle.sum(),
             "moe/load_balance_loss": balance_loss.detach().float()}
    for n, (i, _) in enumerate(layers):
        stats[f"moe/layer{i}/max_over_mean"] = max_over_mean[n]
        stats[f"moe/layer{i}/idle_experts"] = idle[n]
    return stats

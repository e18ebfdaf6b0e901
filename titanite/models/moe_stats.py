"""MoE routing telemetry and the auxiliary load-balancing loss, shared by both backends.

Each MoE layer's forward leaves a `RoutingRecord` (`kernels/routing.py`, recorded at the
`moe.router` call site: the native router's and, through kernels/hf.py, transformers'); the
backend turns the records into the auxiliary loss (transformers' `load_balancing_loss_func` math)
and the expert-load stats logged to metrics.jsonl.
"""

from __future__ import annotations

import torch

from titanite.kernels import context_parallel
from titanite.kernels.routing import RoutingRecord


def pooled(records: list[tuple[int, RoutingRecord]]) -> list[tuple[int, RoutingRecord]]:
    """The layers' records over the whole sequences: under context parallelism each rank routed
    only its chunks, so counts and probabilities are summed over the cp group (one all-reduce of
    each, all layers stacked); otherwise the records as they are."""
    if not records or context_parallel.current() is None:
        return records
    counts, probs, tokens = context_parallel.pool_routing(torch.stack([r.counts for _, r in records]),
                                                          torch.stack([r.prob_sum for _, r in records]),
                                                          records[0][1].num_tokens)
    return [(i, RoutingRecord(c, p, tokens)) for (i, _), c, p in zip(records, counts, probs)]


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

"""What a `moe.router` call site leaves behind, in both backends (the native router,
`models/qwen3/moe.py`, and transformers' router through `kernels/hf.py`).

A layer's forward keeps one `RoutingRecord`: rows routed to each expert and the router
probabilities summed over tokens. The model layer turns the records into the auxiliary loss and
the expert-load telemetry (`models/moe_stats.py`).
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

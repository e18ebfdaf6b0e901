"""Fused MoE experts in memory <-> per-expert tensors on disk, for both backends.

In memory (titanite's native experts and transformers 5.x alike) each MoE layer stacks its
experts: gate_up [E, 2I, H] (every expert's gate rows, then its up rows) and down [E, H, I].
Published checkpoints, and transformers' own save_pretrained, store every expert separately as
`<prefix>.{e}.gate_proj.weight` [I, H], `.up_proj.weight` [I, H] and `.down_proj.weight` [H, I].
Both state-dict adapters call these two functions, so the split exists once.
"""

from __future__ import annotations

import torch

GATE_UP, DOWN = "gate_up", "down"


def split_experts(prefix: str, kind: str, stacked: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One stacked tensor -> its per-expert (HF key, tensor) pairs, in a fixed order (for
    gate_up: gate_0, up_0, gate_1, up_1, ...). Works on meta tensors."""
    if kind == DOWN:  # [E, H, I] -> E x [H, I]
        return [(f"{prefix}.{e}.down_proj.weight", t) for e, t in enumerate(stacked)]
    assert kind == GATE_UP, kind
    inter = stacked.shape[1] // 2  # [E, 2I, H] -> E x (gate [I, H], up [I, H])
    out = []
    for e, t in enumerate(stacked):
        out += [(f"{prefix}.{e}.gate_proj.weight", t[:inter]), (f"{prefix}.{e}.up_proj.weight", t[inter:])]
    return out


def fuse_experts(kind: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of split_experts: the per-expert tensors, in its order -> the stacked tensor."""
    if kind == DOWN:
        return torch.stack(tensors)
    assert kind == GATE_UP, kind
    return torch.stack([torch.cat((gate, up)) for gate, up in zip(tensors[0::2], tensors[1::2], strict=True)])

"""Process-group setup and the few collectives the trainer needs, behind one `World` object.

Single process (plain python or `torchrun --nproc_per_node=1`) needs no process group.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanite.config import ParallelismConfig
from titanite.errors import UserError


@dataclass
class World:
    rank: int = 0
    size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    device: torch.device | None = None
    mesh: object | None = None

    def all_reduce_sum_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def full_tensors(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Gather sharded (DTensor) tensors to full ones, one at a time, on every rank."""
        for key, t in pairs:
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield key, t.detach()


def init(device: torch.device, pcfg: ParallelismConfig) -> World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(device=device)
    raise UserError(f"WORLD_SIZE={size}: multi-process training is not available in this build yet; "
                    f"run with one process (torchrun --nproc_per_node=1)")

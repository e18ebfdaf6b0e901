"""Global gradient-norm clipping over parameters that may be DTensors on different meshes.

`torch.nn.utils.clip_grad_norm_` needs all gradients on one mesh. Under FSDP + TP, or with
expert parallelism, parameters live on several (sub)meshes, so here each gradient contributes
the squared norm of its local shard, summed over exactly the mesh dimensions it is sharded on
(replicated dimensions hold copies and are not summed).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                    stages: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most `max_norm` (inf: never).
    Returns the norm before clipping as a plain fp32 scalar tensor, the same on every rank.
    stages: the pipeline group, whose ranks hold different parameters (their squares are summed)."""
    params = [p for p in parameters if p.grad is not None]
    if stages is None and not any(isinstance(p.grad, DTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    # Group local shards by (mesh, dims they are sharded on): one reduction per group.
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    meshes = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                # A replicated weight used on sharded activations (e.g. a sequence-parallel norm)
                # gets a pending sum over the tensor-parallel ranks: do it now, once.
                g = p.grad = g.redistribute(placements=p.placements)
            shard_dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key = (id(g.device_mesh), shard_dims)
            meshes[key] = g.device_mesh
            groups[key].append(g.to_local())
        else:
            groups[(None, ())].append(g)
    total_sq = None
    for key, grads in groups.items():
        norms = torch._foreach_norm(grads, 2.0)
        sq = torch.stack([n.float() for n in norms]).square().sum()
        mesh_key, shard_dims = key
        for dim in shard_dims:  # summing over one mesh dimension at a time sums over all of them
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=meshes[key].get_group(dim))
        total_sq = sq if total_sq is None else total_sq + sq
    if total_sq is None:  # no gradient on this rank
        total_sq = torch.zeros((), dtype=torch.float32)
    if stages is not None:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=stages)
    total = total_sq.sqrt()
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total

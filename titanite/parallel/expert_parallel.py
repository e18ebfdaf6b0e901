"""Expert parallelism for both backends' MoE: experts sharded over the `ep` ranks, tokens
exchanged with all-to-all.

The router and dispatcher run unchanged on every rank over its own tokens and hand the experts
rows sorted by global expert id with per-expert counts. Expert parallelism replaces only the
experts' forward: rank r holds experts [r*E/ep, (r+1)*E/ep) (the stacked weights are sharded on
dim 0); each rank sends every row to the rank that owns its expert, runs its local experts on
what it received, and sends the results back to where the rows came from, in their original
order. The dispatcher then combines them as on one device.

The same code serves the native `GroupedExperts` (its forward is replaced) and transformers'
fused experts on the hf backend (their `run_experts`, the function titanite's experts-interface
implementation calls between dispatch and combine; see kernels/hf.py): both hold stacked
weights [E, ...] and get (rows sorted by global expert, counts per global expert).

    rows [N, H] by global expert --all-to-all--> [M, H] by (source rank, local expert)
      --sort--> by (local expert, source rank) --experts--> --unsort--> --all-to-all--> [N, H]
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titanite.models.qwen3.moe import GroupedExperts
from titanite.models.stage import present

log = logging.getLogger("titanite")


@contextlib.contextmanager
def _local_shards(module: nn.Module) -> Iterator[None]:
    """Within the block, `module.<param>` reads as this rank's local shard (a plain tensor that
    backpropagates into the DTensor parameter), so the module's own single-device forward runs
    on its local experts. An instance attribute shadows the registered parameter; FSDP's
    parameter swaps (in `_parameters`) are not disturbed."""
    names = [n for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
    for name in names:
        module.__dict__[name] = getattr(module, name).to_local()
    try:
        yield
    finally:
        for name in names:
            del module.__dict__[name]


def _exchange_counts(counts: torch.Tensor, ep: int, group: dist.ProcessGroup) -> torch.Tensor:
    """counts: [E] rows this rank sends to each global expert -> [ep, E/ep]: rows each source
    rank sends to each of this rank's experts."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)  # E/ep counts to each rank
    return received.view(ep, -1)


LocalExperts = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (module, rows, counts)


def expert_parallel_forward(experts: nn.Module, mesh: DeviceMesh, local_forward: LocalExperts):
    """The replacement `forward(x, counts)` for an experts module whose stacked weights are
    sharded over `mesh` (1-D, the ep ranks). x: [N, H] rows sorted by global expert; counts:
    [E] int64 rows per global expert. Returns [N, H]: row n through its expert's SwiGLU.
    local_forward: the single-device computation, run on the local weights and local counts."""
    group = mesh.get_group()
    ep = mesh.size()

    def forward(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        received = _exchange_counts(counts, ep, group)  # [ep, E/ep]
        # Rows per peer rank are needed on the host to size the exchange (one sync per layer).
        send_splits = counts.view(ep, -1).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        rows = all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, group)  # [M, H]
        # Received rows are grouped by (source rank, local expert); the experts need them grouped
        # by local expert. A stable sort on (expert, source) keeps token order inside each group.
        segment = torch.repeat_interleave(torch.arange(received.numel(), device=x.device), received.flatten())
        source, expert = segment // received.shape[1], segment % received.shape[1]
        order = torch.argsort(expert * ep + source, stable=True)
        with _local_shards(experts):
            out = local_forward(experts, rows[order], received.sum(dim=0))
        out = torch.zeros_like(out).index_copy(0, order, out)  # undo the sort
        return all_to_all_single_autograd(out, send_splits, recv_splits, group)

    return forward


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """Shard an experts module's stacked [E, ...] parameters on dim 0 over `mesh`, in place."""
    for name, full in list(experts.named_parameters(recurse=False)):
        sharded = distribute_tensor(full.data, mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=full.requires_grad))


def _report(groups: list[nn.Module], mesh: DeviceMesh) -> list[nn.Module]:
    assert groups, "expert parallelism on a model without MoE layers (checked in ParallelDims.check_model)"
    local = next(groups[0].parameters()).to_local().shape[0]
    log.info("expert parallel: %d MoE layers, %d experts each, %d on this rank (ep=%d)",
             len(groups), local * mesh.size(), local, mesh.size())
    return groups


def apply_expert_parallel_qwen3(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Shard every native MoE layer's experts over `ep_mesh` in place; returns the expert modules
    (FSDP then shards their weights over the ranks that hold the same experts)."""
    groups = []
    for _, block in present(model.layers):
        experts = getattr(block.feed_forward, "experts", None)
        if not isinstance(experts, GroupedExperts):
            continue  # a dense layer (mlp_only_layers, decoder_sparse_step)
        shard_experts(experts, ep_mesh)
        experts.forward = expert_parallel_forward(experts, ep_mesh, type(experts).forward)  # LoRA experts too
        groups.append(experts)
    return _report(groups, ep_mesh)


def apply_expert_parallel_hf(causal_lm: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """The same for a transformers Qwen3-MoE whose experts run titanite's experts interface
    (kernels/hf.py install): each experts module's `run_experts` becomes the exchange."""
    from titanite.kernels.hf import run_local_experts

    groups = []
    for _, layer in present(causal_lm.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue  # a dense layer
        assert hasattr(experts, "run_experts"), "titanite's kernels are installed before expert parallelism"
        shard_experts(experts, ep_mesh)
        experts.run_experts = expert_parallel_forward(experts, ep_mesh, run_local_experts)
        groups.append(experts)
    return _report(groups, ep_mesh)

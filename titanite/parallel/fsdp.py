"""FSDP2 (`fully_shard`) over the data-parallel mesh: FSDP, or HSDP when dp_replicate > 1.

Gradients are summed, not averaged, across data-parallel ranks: the trainer already divides the
loss by the number of valid tokens in the whole global batch, so the sum is the gradient of the
single-process loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
from torch.distributed.tensor import Shard

from titanite.parallel.distributed import World


def mixed_precision_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """'bf16': compute with bf16 copies of the (fp32) parameters, reduce gradients in fp32."""
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def uses_fsdp(world: World) -> bool:
    return world.dims is not None and (world.dims.dp > 1 or world.dims.cp > 1)


def fsdp_groups(embedding: nn.Module | None, blocks: list, head: list) -> list:
    """FSDP groups: the embedding, each block, the final norm with the head; those a pipeline
    stage does not hold left out."""
    head = [m for m in head if m is not None]
    return ([embedding] if embedding is not None else []) + blocks + ([head] if head else [])


def shard_model(root: nn.Module, groups: Sequence[nn.Module | list[nn.Module]], world: World,
                mixed_precision: str, expert_params: Iterable[nn.Parameter] = ()) -> None:
    """fully_shard each group (bottom-up: blocks, then embeddings/head), then the root, which
    takes every parameter not yet in a group.

    Expert-parallel experts (`expert_params`) stay in their block's group but are sharded over
    a different mesh: the data-parallel ranks that hold the same experts (dp_shard / ep). Keeping
    them in the block, rather than in a group of their own nested inside it, keeps FSDP's hooks
    out of the block's activation-checkpointed region, whose recomputation must replay exactly
    the forward's operations."""
    policy = mixed_precision_policy(mixed_precision)
    mesh = world.meshes["fsdp"]
    kw: dict = {"mesh": mesh, "mp_policy": policy}
    experts = {id(p) for p in expert_params}
    if experts:
        placement = ShardPlacementResult(placement=Shard(0), mesh_info=_mesh_info(world.meshes["fsdp_experts"]))
        kw["shard_placement_fn"] = lambda p: placement if id(p) in experts else None
    for group in groups:
        fully_shard(group, **kw)
    fully_shard(root, **kw)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: every backend has it


def _mesh_info(mesh: DeviceMesh):
    """FSDP's description of a 1-D (FSDP) or 2-D (HSDP: replicate, shard) mesh, as fully_shard
    builds it for its own mesh argument. Its documented `shard_placement_fn` takes these
    objects, which torch does not export yet."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    if mesh.ndim == 1:
        return FSDPMeshInfo(mesh, shard_mesh_dim=0)
    return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)

"""Parallel degrees from `[parallelism]`, their checks, and the device mesh built from them.

The world is laid out as `pp x dp_replicate x dp_shard x cp x tp` ranks (pp outermost: pipeline
stages exchange only activations, point to point, so they may sit on different nodes; tp innermost, so a
tensor-parallel group sits on neighbouring ranks, i.e. inside one node; a context-parallel group
next to it, as it exchanges keys and values in every layer). Expert parallelism borrows its ranks
from dp_shard: an `ep` group is `ep` neighbouring dp_shard ranks, and the experts are sharded
across it instead of being FSDP-sharded there. Every other parameter is FSDP-sharded over
dp_shard x cp, as without EP (the cp ranks of a group hold the same weights and different
tokens, so to FSDP they are data-parallel ranks). Every data-parallel rank (dp_replicate x
dp_shard, ep included) reads its own slice of the global batch; its cp ranks split each of its
sequences (titanite/parallel/context.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanite.core.config import ParallelismConfig
from titanite.core.errors import UserError


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    world_size: int
    cp: int = 1
    pp: int = 1

    @classmethod
    def resolve(cls, p: ParallelismConfig, world_size: int) -> ParallelDims:
        """Fill in dp_shard = -1 and check that the degrees multiply to the world size."""
        dp_shard = p.dp_shard
        cp, pp = p.cp, p.pp
        if world_size % pp:
            raise UserError(f"parallelism.pp ({pp}) does not divide the world size {world_size} (torchrun --nnodes x "
                            "--nproc_per_node)")
        lead = f"parallelism.pp ({pp}) x dp_replicate" if pp > 1 else "parallelism.dp_replicate"
        if dp_shard == -1:
            rest = pp * p.dp_replicate * cp * p.tp
            if world_size % rest:
                degrees = f"{lead} ({p.dp_replicate}) x " + (f"cp ({cp}) x " if cp > 1 else "parallelism.")
                raise UserError(
                    f"{degrees}tp ({p.tp}) = {rest} does not divide the world size {world_size}, so "
                    f"parallelism.dp_shard = -1 cannot take the rest")
            dp_shard = world_size // rest
        product = pp * p.dp_replicate * dp_shard * cp * p.tp
        if product != world_size:
            degrees = f"dp_shard ({dp_shard}) x " + (f"cp ({cp}) x " if cp > 1 else "")
            raise UserError(
                f"{lead} ({p.dp_replicate}) x {degrees}tp ({p.tp}) = {product}, but the world size "
                f"is {world_size} (torchrun --nnodes x --nproc_per_node); make the product match or set "
                f"parallelism.dp_shard = -1")
        if dp_shard % p.ep:
            raise UserError(
                f"parallelism.ep ({p.ep}) must divide parallelism.dp_shard ({dp_shard}): expert-parallel ranks "
                f"are taken from the sharded data-parallel ranks")
        if p.compile and p.tp > 1:
            # Compiled blocks fail in backward at the sequence-parallel redistributions.
            raise UserError(f"parallelism.compile = true together with parallelism.tp ({p.tp}) is not supported; "
                            f"turn one of them off")
        return cls(p.dp_replicate, dp_shard, p.tp, p.ep, world_size, cp, pp)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads a different slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    def check_model(self, hf_config: dict[str, Any]) -> None:
        """Degrees that must divide the architecture (from the model's config.json dict)."""
        where = "the model (config.json)"
        checks = []
        if self.tp > 1:
            checks += [("tp", self.tp, "num_attention_heads"), ("tp", self.tp, "num_key_value_heads"),
                       ("tp", self.tp, "vocab_size")]
            # An MoE model without dense layers may have no intermediate_size; its MoE blocks are unsplit.
            if hf_config.get("intermediate_size") is not None or not hf_config.get("num_experts"):
                checks.append(("tp", self.tp, "intermediate_size"))
            if hf_config.get("linear_num_key_heads"):  # Gated DeltaNet: whole key heads per rank
                checks += [("tp", self.tp, "linear_num_key_heads"), ("tp", self.tp, "linear_num_value_heads")]
        if self.ep > 1:
            if not hf_config.get("num_experts"):
                raise UserError(f"parallelism.ep = {self.ep} but {where} is dense (no num_experts); set ep = 1")
            checks.append(("ep", self.ep, "num_experts"))
        for key, degree, field in checks:
            value = hf_config.get(field)
            if value is None or value % degree:
                raise UserError(f"parallelism.{key} ({degree}) must divide {field} ({value}) of {where}")

    @property
    def fsdp_shard(self) -> int:
        """Ranks a parameter is FSDP-sharded over: dp_shard x cp."""
        return self.dp_shard * self.cp

    def build_meshes(self, device_type: str) -> dict[str, DeviceMesh]:
        """The device meshes, by role. 'world' is (pp, dp_replicate, dp_shard, cp, tp); 'pp' its
        pipeline dim and (pp > 1) 'stage' the ranks of one pipeline rank's stages; 'dp' its
        flattened data-parallel ranks; 'cp' and 'tp'; 'loss' the ranks a step's loss and token
        count are summed over (dp x cp); 'fsdp' the FSDP mesh (1-D dp_shard x cp, or 2-D
        (dp_replicate, dp_shard x cp) for HSDP). With EP, dp_shard is split into
        (dp_shard_mod_ep, ep): 'ep' shards the experts and 'fsdp_experts' FSDP-shards them over
        the ranks that hold the same experts (dp_shard_mod_ep x cp)."""
        names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        world = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                 mesh_dim_names=names)
        meshes = {"world": world, "dp": world["dp_replicate", "dp_shard"]._flatten("dp"), "tp": world["tp"],
                  "cp": world["cp"], "pp": world["pp"]}
        if self.pp > 1:  # the ranks of one pipeline rank's stages
            meshes["stage"] = world["dp_replicate", "dp_shard", "cp", "tp"]._flatten("stage")
        meshes["loss"] = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp") if self.cp > 1 else meshes["dp"]
        if self.cp == 1:
            meshes["fsdp"] = world["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else world["dp_shard"]
        elif self.dp_replicate == 1:
            meshes["fsdp"] = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        elif self.ep == 1:  # HSDP's 2-D mesh with a flattened shard dim: a mesh of its own over the same ranks
            meshes["fsdp"] = self._regroup(device_type, [("dp_replicate",), ("dp_shard", "cp"), ("tp",)])[
                "dp_replicate", "dp_shard_cp"]
        if self.ep > 1:
            split = world._unflatten("dp_shard", (self.dp_shard // self.ep, self.ep), ("dp_shard_mod_ep", "ep"))
            meshes["ep"] = split["ep"]
            if self.cp == 1:
                meshes["fsdp_experts"] = (split["dp_replicate", "dp_shard_mod_ep"] if self.dp_replicate > 1
                                          else split["dp_shard_mod_ep"])
            elif self.dp_replicate == 1:
                meshes["fsdp_experts"] = split["dp_shard_mod_ep", "cp"]._flatten("dp_shard_mod_ep_cp")
            else:
                # HSDP: FSDP wants the experts' meshes (ep, then their own) derived from the
                # others' one. Its shard dim orders the ranks (dp_shard/ep, cp, ep), so
                # unflattening that dim gives both.
                hsdp = self._regroup(device_type, [("dp_replicate",), ("dp_shard_mod_ep", "cp", "ep"), ("tp",)])
                shard = "dp_shard_mod_ep_cp_ep"
                meshes["fsdp"] = hsdp["dp_replicate", shard]
                experts = hsdp._unflatten(shard, (self.dp_shard // self.ep * self.cp, self.ep),
                                          ("dp_shard_mod_ep_cp", "ep_of_shard"))
                meshes["fsdp_experts"] = experts["dp_replicate", "dp_shard_mod_ep_cp"]
                meshes["ep"] = experts["ep_of_shard"]  # the same ranks as split's, from the same root
        return meshes

    def _regroup(self, device_type: str, groups: list[tuple[str, ...]]) -> DeviceMesh:
        """A mesh over the world whose dims are groups of the world's dims, each group flattened
        into one (named by joining its members), e.g. [(dp_replicate,), (dp_shard, cp), (tp,)]."""
        import torch

        groups = [("pp",), *groups]  # the outermost dim: each pipeline rank's submesh is its own
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard_mod_ep": self.dp_shard // self.ep,
                 "ep": self.ep, "cp": self.cp, "tp": self.tp}
        order = [name for group in groups for name in group]
        if "dp_shard_mod_ep" not in order:  # the world's own dp_shard, unsplit
            sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                     "tp": self.tp}
        names = list(sizes)
        ranks = torch.arange(self.world_size).view(*sizes.values()).permute(*[names.index(n) for n in order])
        shape = [math.prod(sizes[n] for n in group) for group in groups]
        return DeviceMesh(device_type, ranks.reshape(shape), mesh_dim_names=tuple("_".join(g) for g in groups))

    def describe(self) -> str:
        parts = [f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}", f"tp={self.tp}", f"ep={self.ep}"]
        if self.cp > 1:
            parts.insert(2, f"cp={self.cp}")
        if self.pp > 1:
            parts.insert(0, f"pp={self.pp}")
        return f"{self.world_size} ranks ({', '.join(parts)})"

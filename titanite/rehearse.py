"""`titanite estimate --rehearse`: the real parallel plan, applied to the real model on the meta
device under PyTorch's fake process group of N ranks, on this CPU, in seconds.

Nothing is allocated and nothing is communicated: the model is built on the meta device, every
parallel style (tensor, expert, FSDP2/HSDP, checkpointing) is applied as training applies it,
and each rank's figures are read from the parameters the plan leaves it with (their local
shards, FSDP's padding included). One rehearsal per rank asked for (by default the first and the
last, where uneven shards differ); a rank is a process-group rank of the fake group.

Reported per rank, in bytes:
- parameters (the stored dtype of each local shard), gradients (fp32, trainable shards only),
  AdamW's two fp32 moments (trainable shards only);
- the checkpoint bytes the rank reads at start-up: today every rank reads every tensor of
  model.hf_path in full (titanite/checkpoint/hf_weights.py), so it is the whole checkpoint;
- the start-up peak: today every rank materialises and loads (or initialises) the whole model
  before the plan shards it, so the peak is the whole model in its stored dtypes plus the
  rank's shards that FSDP copies out of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from titanite.config import Config, KernelsConfig

GiB = 2**30


@dataclass(frozen=True)
class RankFigures:
    rank: int
    params: int  # bytes
    grads: int
    optimizer: int
    checkpoint_read: int
    startup_peak: int

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer


def _checkpoint_bytes(cfg: Config) -> int:
    """What a rank reads from model.hf_path today: every safetensors file whole (none for a
    random init or a folder holding only config.json)."""
    if not cfg.model.hf_path or cfg.model.init == "random":
        return 0
    return sum(f.stat().st_size for f in sorted(Path(cfg.model.hf_path).glob("*.safetensors")))


def rehearse_rank(cfg: Config, world_size: int, rank: int) -> RankFigures:
    """One rank of `world_size`, under a fake process group started (and torn down) here."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanite.models.spec import get_spec
    from titanite.parallel.distributed import World
    from titanite.parallel.mesh import ParallelDims
    from titanite.parallel.plans import parallelize
    from titanite.preflight import check_layout

    dims = ParallelDims.resolve(cfg.parallelism, world_size)
    handle = get_spec(cfg.model.spec).build(cfg.model)
    if cfg.lora.enabled:
        handle.apply_lora(cfg.lora)
    check_layout(dims, handle)
    # Call sites only (which implementation runs changes no parameter): the transformers
    # backend's expert parallelism enters through them.
    handle.attach_kernels(KernelsConfig(), "cpu", torch.float32)
    full = sum(p.numel() * p.element_size() for p in _unique(handle.module.parameters()))
    assert not dist.is_initialized(), "a rehearsal needs a process of its own (no process group yet)"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        meshes = dims.build_meshes("cpu")
        world = World(rank=rank, size=world_size, dp_rank=meshes["dp"].get_local_rank(),
                      dp_size=meshes["dp"].size(), device=torch.device("cpu"), meshes=meshes, dims=dims)
        parallelize(handle, world, cfg)
        params = grads = 0
        for p in _unique(handle.module.parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            # The storage, not the view: FSDP pads every rank's shard to the same size and
            # allocates it even where the rank's rows are none (16 experts over 32 ranks).
            stored = local.untyped_storage().nbytes()
            params += stored
            if p.requires_grad:
                grads += stored // local.element_size() * 4
    finally:
        dist.destroy_process_group()
    return RankFigures(rank, params, grads, 2 * grads, _checkpoint_bytes(cfg), full + params)


def _unique(params):
    seen = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def rehearse(cfg: Config, world_size: int, ranks: list[int] | None = None) -> list[RankFigures]:
    ranks = ranks if ranks is not None else sorted({0, world_size - 1})
    for r in ranks:
        if not 0 <= r < world_size:
            raise ValueError(f"rank {r} is not in a world of {world_size}")
    return [rehearse_rank(cfg, world_size, r) for r in ranks]


def fitting_layout(cfg: Config, world_size: int, device_gib: float) -> str | None:
    """The first layout of `world_size` ranks whose estimated training peak fits `device_gib`:
    tensor parallel 1, 2, 4, 8, then (MoE) expert parallel over the sharded ranks, then full
    activation checkpointing; None when none does."""
    import copy
    import itertools

    from titanite.errors import UserError
    from titanite.estimate import estimate

    moe = bool(_num_experts(cfg))
    for ac, tp, ep in itertools.product((cfg.parallelism.activation_checkpoint, "full"), (1, 2, 4, 8),
                                        (1, 2, 4, 8, 16, 32, 64) if moe else (1,)):
        trial = copy.deepcopy(cfg)
        p = trial.parallelism
        p.activation_checkpoint, p.tp, p.ep, p.dp_shard, p.dp_replicate = ac, tp, ep, -1, 1
        try:
            total = estimate(trial, world_size).total
        except UserError:  # degrees that do not divide the world or the model
            continue
        if total / GiB <= device_gib:
            return (f"dp_shard = {world_size // tp}, tp = {tp}, ep = {ep}, activation_checkpoint = '{ac}' "
                    f"(estimated training peak {total / GiB:.1f} GiB)")
    return None


def _num_experts(cfg: Config) -> int:
    from titanite.models.spec import get_spec

    return get_spec(cfg.model.spec).build(cfg.model).args.num_experts or 0


def report(figures: list[RankFigures], device_gib: float | None) -> str:
    lines = ["rehearsal (the real plan on the meta device, fake process group), per rank:",
             f"  {'rank':>6} {'parameters':>12} {'gradients':>12} {'optimizer':>12} {'states':>12} "
             f"{'reads':>12} {'start-up peak':>14}  (GiB)"]
    for f in figures:
        lines.append(f"  {f.rank:>6} {f.params / GiB:12.3f} {f.grads / GiB:12.3f} {f.optimizer / GiB:12.3f} "
                     f"{f.states / GiB:12.3f} {f.checkpoint_read / GiB:12.3f} {f.startup_peak / GiB:14.3f}")
    lines.append("  start-up peak: every rank materialises the whole model before sharding it (today's "
                 "start-up); reads: every rank reads the whole checkpoint")
    if device_gib:
        worst = max(f.startup_peak for f in figures) / GiB
        if worst > device_gib:
            lines.append(f"  does not start on {device_gib:g} GiB: the start-up peak is {worst:.1f} GiB on some rank, "
                         "whatever the layout (the whole model is materialised on every rank)")
    return "\n".join(lines)

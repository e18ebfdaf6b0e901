"""`titanite estimate --rehearse`: the real parallel plan, applied to the real model on the meta
device under PyTorch's fake process group of N ranks, on this CPU, in seconds.

Nothing is allocated and nothing is communicated: the model is built on the meta device, every
parallel style (tensor, expert, FSDP2/HSDP, checkpointing) is applied as training applies it,
and each rank's figures are read from the parameters the plan leaves it with (their local
shards, FSDP's padding included). Under pipeline parallelism the model is first cut to the
rank's stages, as training cuts it (the layout preflight resolves; parallelize(..., parts)), so
the figures are those of the real stages. One rehearsal per rank asked for (by default the first
and the last, where uneven shards differ, and under pipeline parallelism the first and the last
pipeline rank); a rank is a process-group rank of the fake group.

Reported per rank, in bytes:
- parameters (the stored dtype of each local shard), gradients (fp32, trainable shards only),
  AdamW's two fp32 moments (trainable shards only);
- the checkpoint bytes the rank reads at start-up: the slices of the on-disk tensors that fall
  in its shards (titanite/formats/sharded.py), at the checkpoint's bytes per element;
- the start-up peak: the trainer allocates only the rank's shards and fills them one on-disk
  tensor at a time, so the peak is the shards plus the largest tensor of the Hugging Face layout
  (one expert's matrix for MoE experts), counted in fp32 as a random init draws it;
- for a DPO run whose reference is a second model (titanite/run/preference/reference.py), that model
  too: built, sharded by the same plan (without activation checkpointing, as the trainer
  does) and frozen, its parameters' stored bytes (`reference`; in the start-up peak as well). A
  LoRA run's reference is its own base (adapters off) and a precomputed one is not held: none.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from titanite.core.config import Config, KernelsConfig
from titanite.core.config_checks import validate
from titanite.core.errors import UserError
from titanite.formats.safetensors_io import read_header
from titanite.formats.sharded import local_part
from titanite.models.spec import get_spec
from titanite.parallel import pipeline_layout
from titanite.parallel.distributed import World
from titanite.parallel.mesh import ParallelDims
from titanite.parallel.plans import parallelize
from titanite.plan.counts import GiB
from titanite.plan.estimator import estimate
from titanite.plan.phases import accumulation_steps
from titanite.plan.pipeline_costs import rank_parts
from titanite.run.preference.reference import reference_model_config
from titanite.run.preflight import check_layout


@dataclass(frozen=True)
class RankFigures:
    rank: int
    params: int  # bytes
    grads: int
    optimizer: int
    checkpoint_read: int
    startup_peak: int
    reference: int = 0  # a DPO run's second (frozen) model: its parameters' stored bytes
    pp_rank: int = 0  # its pipeline rank (0 without pipeline parallelism)

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer


def _checkpoint_bytes(cfg: Config) -> int:
    """The tensor bytes of model.hf_path's safetensors files (0 for a random init or a folder
    holding only config.json)."""
    if not cfg.model.hf_path or cfg.model.init == "random":
        return 0
    return sum(end - begin for f in sorted(Path(cfg.model.hf_path).glob("*.safetensors"))
               for begin, end in (info["data_offsets"] for info in read_header(f).values()))


def _start_up(handle) -> tuple[int, int, int]:
    """(elements of the HF layout this rank holds, elements of the whole layout it holds tensors of,
    elements of its largest tensor), from the sharded (meta) model."""
    adapter, held, whole, largest, seen = handle.base_adapter(), 0, 0, 0, set()
    for name, t in handle.module.state_dict(keep_vars=True).items():
        if id(t) in seen or adapter.skips(name):
            continue
        seen.add(id(t))
        pieces = adapter.to_hf(name, torch.empty(t.shape, dtype=t.dtype, device="meta"))
        if pieces:
            held += prod(local_part(t).shape)
            whole += t.numel()
            largest = max(largest, *(p.numel() for _, p in pieces))
    return held, whole, largest


def rehearse_rank(cfg: Config, world_size: int, rank: int) -> RankFigures:
    """One rank of `world_size`, under a fake process group started (and torn down) here."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = ParallelDims.resolve(cfg.parallelism, world_size)
    handle = get_spec(cfg.model.spec).build(cfg.model)
    if cfg.lora.enabled:
        handle.apply_lora(cfg.lora)
    check_layout(dims, handle)
    layout = pipeline_layout.check(cfg, dims, handle, accumulation_steps(cfg, dims))
    # Call sites only (which implementation runs changes no parameter): the transformers
    # backend's expert parallelism enters through them.
    handle.attach_kernels(KernelsConfig(), "cpu", torch.float32)
    whole = _start_up(handle)[1]  # the whole model's layout, before a pipeline rank's cut
    assert not dist.is_initialized(), "a rehearsal needs a process of its own (no process group yet)"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        meshes = dims.build_meshes("cpu")
        world = World(rank=rank, size=world_size, dp_rank=meshes["dp"].get_local_rank(),
                      dp_size=meshes["dp"].size(), device=torch.device("cpu"), meshes=meshes, dims=dims)
        parts = rank_parts(layout, world.pp_rank) if layout is not None else None
        parallelize(handle, world, cfg, parts)
        params = grads = 0
        for p in _unique(handle.module.parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            # The storage, not the view: FSDP pads every rank's shard to the same size and
            # allocates it even where the rank's rows are none (16 experts over 32 ranks).
            stored = local.untyped_storage().nbytes()
            params += stored
            if p.requires_grad:
                grads += stored // local.element_size() * 4
        held, _, largest = _start_up(handle)
        reference = _reference_bytes(cfg, dims, world)
        pp_rank = world.pp_rank
    finally:
        dist.destroy_process_group()
    read = round(_checkpoint_bytes(cfg) * held / whole) if whole else 0
    return RankFigures(rank, params, grads, 2 * grads, read, params + reference + 4 * largest, reference, pp_rank)


def _reference_bytes(cfg: Config, dims: ParallelDims, world: World) -> int:
    """The stored bytes of this rank's shards of a DPO run's separate reference model, built and
    sharded as the trainer does (titanite/run/preference/reference.py); 0 when there is none."""
    mcfg = reference_model_config(cfg)
    if mcfg is None or cfg.preference.reference == "precomputed":  # precomputed: dropped before training
        return 0
    handle = get_spec(mcfg.spec).build(mcfg)
    check_layout(dims, handle)
    handle.attach_kernels(KernelsConfig(), "cpu", torch.float32)
    p = cfg.parallelism
    parallelize(handle, world, dataclasses.replace(
        cfg, model=mcfg, parallelism=dataclasses.replace(p, activation_checkpoint="none"),
        lora=dataclasses.replace(cfg.lora, enabled=False)))
    stored = 0
    for t in _unique(handle.module.parameters()):
        stored += (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes()
    return stored


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


def fitting_layout(cfg: Config, world_size: int, device_gib: float, on_gloo: bool | None = None) -> str | None:
    """The first layout of `world_size` ranks whose estimated training peak fits `device_gib`:
    with the config's activation checkpointing, then with 'full'; at each, the config's pipeline
    degree, then none, then 2, 4, 8 and 16 pipeline ranks (the config's schedule, balanced stages,
    the step's micro-batches in one pass); at each, the fewest ranks per sequence first (context
    parallel x tensor parallel: 1, 2, 4, ...; context parallelism first at the same product, as its
    key/value gathers move less than tensor parallelism's activations), cp only where data.seq_len
    cuts into 2 x cp x tp chunks; then (MoE) expert parallel over the sharded ranks; None when none
    does."""
    handle = get_spec(cfg.model.spec).build(cfg.model)
    moe = bool(handle.args.num_experts)
    split = sorted(((cp, tp) for cp in _powers(world_size) for tp in (1, 2, 4, 8)
                    if cp * tp <= world_size and (cp == 1 or cfg.data.seq_len % (2 * cp * tp) == 0)),
                   key=lambda x: (x[0] * x[1], x[1]))
    pps = [pp for pp in dict.fromkeys((cfg.parallelism.pp, 1, 2, 4, 8, 16)) if world_size % pp == 0]
    for ac, pp, (cp, tp), ep in itertools.product(dict.fromkeys((cfg.parallelism.activation_checkpoint, "full")),
                                                  pps, split, (1, 2, 4, 8, 16, 32, 64) if moe else (1,)):
        trial = copy.deepcopy(cfg)
        p = trial.parallelism
        p.activation_checkpoint, p.tp, p.cp, p.ep, p.dp_shard, p.dp_replicate = ac, tp, cp, ep, -1, 1
        if pp != cfg.parallelism.pp:
            p.pp, p.pp_split, p.pp_microbatches = pp, [], 0
        try:
            # cheap checks first: degrees that do not divide the world, a pipeline the config refuses
            dims = ParallelDims.resolve(p, world_size)
            pipeline_layout.check(trial, dims, handle, accumulation_steps(trial, dims))
            validate(trial)  # LoRA refuses some layouts (lora.dropout with tp > 1), CP others: no answer
            total = estimate(trial, world_size, on_gloo=on_gloo, device_memory=device_gib * GiB).total
        except UserError:  # degrees the config refuses, or that do not divide the world or the model
            continue
        if total / GiB <= device_gib:
            return ((f"pp = {pp} ({p.pp_schedule}), " if pp > 1 else "")
                    + f"dp_shard = {world_size // (pp * cp * tp)}, " + (f"cp = {cp}, " if cp > 1 else "")
                    + f"tp = {tp}, ep = {ep}, activation_checkpoint = '{ac}' "
                    f"(estimated training peak {total / GiB:.1f} GiB)")
    return None


def _powers(n: int) -> list[int]:
    """The powers of 2 that divide n."""
    return [2**i for i in range(n.bit_length()) if n % 2**i == 0]


def report(figures: list[RankFigures], device_gib: float | None) -> str:
    ref = any(f.reference for f in figures)
    pp = any(f.pp_rank for f in figures)
    lines = ["rehearsal (the real plan on the meta device, fake process group), per rank:",
             f"  {'rank':>6} " + (f"{'pp rank':>7} " if pp else "") + f"{'parameters':>12} {'gradients':>12} "
             f"{'optimizer':>12} {'states':>12} " + (f"{'reference':>12} " if ref else "")
             + f"{'reads':>12} {'start-up peak':>14}  (GiB)"]
    for f in figures:
        lines.append(f"  {f.rank:>6} " + (f"{f.pp_rank:>7} " if pp else "")
                     + f"{f.params / GiB:12.3f} {f.grads / GiB:12.3f} {f.optimizer / GiB:12.3f} "
                     f"{f.states / GiB:12.3f} " + (f"{f.reference / GiB:12.3f} " if ref else "")
                     + f"{f.checkpoint_read / GiB:12.3f} {f.startup_peak / GiB:14.3f}")
    lines.append("  start-up peak: the rank's shards plus the largest on-disk tensor (fp32); reads: the "
                 "checkpoint slices that fall in the rank's shards"
                 + ("; reference: the DPO reference model's shards (frozen)" if ref else ""))
    if device_gib:
        worst = max(f.startup_peak for f in figures) / GiB
        if worst > device_gib:
            lines.append(f"  does not start on {device_gib:g} GiB: the start-up peak is {worst:.1f} GiB on some rank")
    return "\n".join(lines)

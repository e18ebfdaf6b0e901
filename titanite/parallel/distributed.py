"""Process-group setup and the few collectives the trainer needs, behind one `World` object.

A single process (plain python or `torchrun --nproc_per_node=1`) needs no process group. Under
torchrun with more processes, the backend comes from the device (gloo on CPU, the device's own
elsewhere) and every collective has a timeout, so a dead or stuck rank fails the job instead of
hanging it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanite.core.config import ParallelismConfig
from titanite.device.choice import dist_backend, process_group_kwargs
from titanite.formats.sharded import Index, local_box
from titanite.parallel.mesh import ParallelDims

log = logging.getLogger("titanite")


@dataclass
class World:
    rank: int = 0
    size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    device: torch.device | None = None
    meshes: dict[str, DeviceMesh] = field(default_factory=dict)  # by role, see ParallelDims.build_meshes
    dims: ParallelDims | None = None

    @property
    def tp(self) -> int:
        return self.dims.tp if self.dims else 1

    @property
    def cp(self) -> int:
        return self.dims.cp if self.dims else 1

    @property
    def pp(self) -> int:
        return self.dims.pp if self.dims else 1

    @property
    def pp_rank(self) -> int:
        return self.meshes["pp"].get_local_rank() if self.pp > 1 else 0

    def all_reduce_sum_pp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` in place over this rank's pipeline ranks (one per stage group)."""
        if self.pp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.meshes["pp"].get_group())
        return t

    @property
    def loss_ranks(self) -> int:
        """Ranks whose losses add up to the step's: the data-parallel ranks x their cp ranks."""
        return self.dp_size * self.cp

    def all_reduce_sum_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` in place over the data-parallel ranks (tensor- and context-parallel peers hold
        the same value)."""
        if self.dp_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.meshes["dp"].get_group())
        return t

    def all_reduce_sum_loss(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` in place over the ranks that hold different tokens: data-parallel x
        context-parallel (each cp rank's loss and token count cover its chunks only)."""
        if self.loss_ranks > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.meshes["loss"].get_group())
        return t

    def all_reduce_sum_cp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` in place over this rank's context-parallel group (the whole sequences' value)."""
        if self.cp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.meshes["cp"].get_group())
        return t

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on at least one (e.g. a signal to stop)."""
        if self.size == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` in place over every rank."""
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` over all ranks (a collective; the value itself on one rank)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        """Forward loss and backward run in this: with tensor parallelism the logits stay
        sharded over the vocabulary and cross-entropy is computed across the shards."""
        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def close(self, in_step: bool = True) -> None:
        """Tear the process group down. `in_step`: every rank got here on the same path (the
        run finished or stopped together), so they meet at a barrier first and no rank tears
        its connections down while a peer still talks to it; after a rank-local failure there
        is no barrier (the peers may be gone)."""
        if self.size > 1 and dist.is_initialized():
            if in_step:
                dist.barrier()
            dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a command with `code`. A rank of a multi-process job exits without interpreter
    finalisation: everything it writes is flushed and closed by then, and finalisation could
    tear down the communication library's threads in an order that aborts the process
    (SIGABRT, "terminate called without an active exception") after a run that succeeded."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def global_rank() -> int:
    """This process's rank in the default group; 0 when there is none (one process)."""
    return dist.get_rank() if dist.is_initialized() else 0


def global_world_size() -> int:
    """The number of processes in the default group; 1 when there is none."""
    return dist.get_world_size() if dist.is_initialized() else 1


def gather_texts(text: str, group: dist.ProcessGroup | None = None) -> list[str]:
    """Every rank's `text`, in rank order, on every rank of `group` (default: the default group;
    one rank: [text]). Sent as bytes in CPU tensors: nothing is pickled."""
    if not dist.is_initialized():
        return [text]
    raw = text.encode()
    data = torch.tensor(list(raw), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([len(raw)], dtype=torch.int64), group=group)
    width = max(int(n) for n in sizes)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: len(raw)] = data
    bufs = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(bufs, padded, group=group)
    return [bytes(b[: int(n)].tolist()).decode() for b, n in zip(bufs, sizes, strict=True)]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to the full tensor (a collective: every rank of its mesh calls it);
    other tensors as they are. Differentiable, so a loss-parallel loss can be backpropagated
    through it."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_regions(name: str, t: torch.Tensor, indices: list[Index]) -> Iterator[torch.Tensor]:
    """A `RegionGather` that gives every rank every region: the whole tensor is gathered first
    (a collective over its mesh), so each rank holds it while its regions are taken."""
    full = full_tensor(t.detach())
    return (full[index] for index in indices)


def regions_to_rank_zero(name: str, t: torch.Tensor, indices: list[Index],
                         group: dist.ProcessGroup | None = None) -> Iterator[torch.Tensor]:
    """A `RegionGather` that assembles each region on rank 0 (of `group`, default: of the world)
    alone, from the ranks that own its parts: no rank holds more than its shards plus the region
    being assembled (rank 0) or one part of its own shard (the others), and the other ranks get
    meta tensors of the regions' shapes. The ranks first share their boxes (one small all-gather
    per tensor); each part is then sent by the lowest rank that holds it (replicas send nothing)."""
    t = t.detach()
    single = not dist.is_initialized() or dist.get_world_size(group) == 1
    if single or not hasattr(t, "device_mesh"):  # unsharded: every rank holds the same tensor
        rank = 0 if single else dist.get_rank(group)
        yield from (t[index] if rank == 0 else _meta_region(t, index) for index in indices)
        return
    rank, local = dist.get_rank(group), t.to_local()
    offsets, sizes = local_box(t)
    mine = torch.tensor([*offsets, *sizes], dtype=torch.int64, device=local.device)
    boxes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(boxes, mine, group=group)
    owners: dict[tuple[int, ...], int] = {}
    for r, box in enumerate(boxes):
        owners.setdefault(tuple(box.tolist()), r)  # the lowest rank holding each distinct box
    zero = 0 if group is None else dist.get_global_rank(group, 0)

    def peer(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    for index in indices:
        lo, hi = region_bounds(t.shape, index)
        out = torch.empty([b - a for a, b in zip(lo, hi)], dtype=t.dtype, device=local.device) if rank == 0 else None
        for box, owner in owners.items():
            start, size = box[: t.ndim], box[t.ndim:]
            a = [max(x, o) for x, o in zip(lo, start)]
            b = [min(y, o + n) for y, o, n in zip(hi, start, size)]
            if any(x >= y for x, y in zip(a, b)) or rank not in (0, owner):
                continue
            into_out = tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))
            if owner == rank:
                part = local[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, start))]
                if rank == 0:
                    out[into_out].copy_(part)
                else:
                    dist.send(part.contiguous(), dst=zero)
            elif out[into_out].is_contiguous():  # rank 0 receives the part `owner` holds in place
                dist.recv(out[into_out], src=peer(owner))
            else:
                part = torch.empty([y - x for x, y in zip(a, b)], dtype=t.dtype, device=local.device)
                dist.recv(part, src=peer(owner))
                out[into_out].copy_(part)
                del part
        yield out.reshape(_meta_region(t, index).shape) if rank == 0 else _meta_region(t, index)


def _meta_region(t: torch.Tensor, index: Index) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")[index]


def region_bounds(shape: torch.Size, index: Index) -> tuple[list[int], list[int]]:
    """[lo, hi) per dim of the region `index` (slices with explicit bounds, ints, or fewer
    entries than dims) of a tensor of `shape`."""
    lo, hi = [], []
    for d, n in enumerate(shape):
        ix = index[d] if d < len(index) else slice(0, n)
        if isinstance(ix, int):
            lo.append(ix)
            hi.append(ix + 1)
        else:
            start, stop, step = ix.indices(n)
            assert step == 1, index
            lo.append(start)
            hi.append(stop)
    return lo, hi


def local_numel(model: torch.nn.Module) -> int:
    """Parameter elements this rank stores (its shards of DTensor parameters, padding included)."""
    total = 0
    for p in model.parameters():
        if hasattr(p, "to_local"):
            p = p.to_local()
        # The storage, not the view: FSDP allocates a padded shard even where a rank's rows are none.
        total += p.untyped_storage().nbytes() // p.element_size()
    return total


def init(device: torch.device, pcfg: ParallelismConfig) -> World:
    """Start the process group (when launched with WORLD_SIZE > 1) and build the device mesh.

    Raises UserError before any collective when the degrees do not match the world size."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.resolve(pcfg, size)
    if size == 1:
        return World(device=device, dims=dims)
    rank = int(os.environ["RANK"])
    if not dist.is_initialized():
        backend = dist_backend(device)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=pcfg.collective_timeout_s),
                                **process_group_kwargs(device, backend))
    meshes = dims.build_meshes(device.type)
    dp_mesh = meshes["dp"]
    world = World(rank=rank, size=size, dp_rank=dp_mesh.get_local_rank(), dp_size=dp_mesh.size(),
                  device=device, meshes=meshes, dims=dims)
    log.info("distributed: %s, backend %s, collective timeout %ds", dims.describe(),
             dist.get_backend(), pcfg.collective_timeout_s)
    return world

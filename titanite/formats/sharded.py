"""Filling a model whose parameters are already sharded, one rank at a time.

The trainer shards the model on the meta device, allocates only each rank's local shards, and
only then loads or initialises them (docs/distributed.md, "Start-up"). This module does the
last step. For every parameter and persistent buffer it works out

- the box of the global tensor this rank holds (`local_box`: offsets and sizes, from the
  DTensor's mesh and placements; a plain tensor is its whole box), and
- where each tensor of the Hugging Face layout sits in the global tensor (`hf_regions`: the
  state-dict adapter's `to_hf` run on a meta tensor returns views, whose offsets and strides
  say which slice each on-disk tensor is; fused MoE experts give one region per expert),

and copies the intersection of the two from a `Source`: a published checkpoint read with
safetensors' `get_slice` (only those bytes are read), or a seeded random draw.

Random init is a function of (job.seed, Hugging Face key) only, never of the layout or of what
was drawn before: each on-disk tensor (one expert's matrix for MoE) is drawn whole from its own
generator and each rank keeps its slice. So a rank holds at most its shards plus one on-disk
tensor, and every layout, and both backends, start from the same weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn

Index = tuple[slice | int, ...]


def name_seed(*parts: object) -> int:
    """A 63-bit generator seed from a tuple of names and numbers (stable across processes)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard (sharing its storage), else itself."""
    return t.to_local() if hasattr(t, "to_local") else t


Box = tuple[tuple[int, ...], tuple[int, ...]]

# How a sharded tensor's box is found: the parallel layer, which creates DTensors, registers it
# (titanite/parallel/__init__.py), so this module, reached from the model layer, never imports
# torch.distributed (tests/architecture/test_layers.py).
_sharded_box: Callable[[torch.Tensor], Box] | None = None


def register_sharded_box(locate: Callable[[torch.Tensor], Box]) -> None:
    global _sharded_box
    _sharded_box = locate


def local_box(t: torch.Tensor) -> Box:
    """(offsets, sizes) of this rank's part of `t` in the global tensor's coordinates."""
    if not hasattr(t, "device_mesh"):
        return (0,) * t.ndim, tuple(t.shape)
    if _sharded_box is None:
        raise RuntimeError("a sharded tensor (DTensor) reached titanite.formats.sharded, but no box locator "
                           "is registered: import titanite.parallel before filling a sharded model")
    offsets, sizes = _sharded_box(t)
    assert sizes == tuple(local_part(t).shape), (sizes, local_part(t).shape, t.placements)
    return offsets, sizes


def box_index(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


@torch.no_grad()
def copy_local(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's box of `full` (the whole tensor, small: e.g. a LoRA factor) into `target`."""
    local_part(target).copy_(full[box_index(*local_box(target))])


def view_index(whole: torch.Tensor, piece: torch.Tensor) -> Index | None:
    """The index with `whole[index]` being the view `piece` (both meta tensors, `whole`
    contiguous), or None when `piece` is not such a view (an adapter that transposes or copies)."""
    if piece is not whole and piece._base is not whole:
        # A new tensor (a row permutation, a concatenation) can have whole's shape and strides
        # without being whole: only a view of it says where it sits.
        return None
    if piece.shape == whole.shape and piece.storage_offset() == 0 and piece.stride() == whole.stride():
        return ()
    rest, starts = piece.storage_offset(), []
    for stride in whole.stride():
        starts.append(rest // stride)
        rest %= stride
    index: list[slice | int] = []
    j = 0
    for d, stride in enumerate(whole.stride()):
        if j < piece.ndim and piece.stride(j) == stride and len(whole.shape) - d >= piece.ndim - j:
            index.append(slice(starts[d], starts[d] + piece.shape[j]))
            j += 1
        else:
            index.append(starts[d])
    view = whole[tuple(index)]
    same = (j == piece.ndim and view.shape == piece.shape and view.stride() == piece.stride()
            and view.storage_offset() == piece.storage_offset())
    return tuple(index) if same else None


# regions(name, t, indices): for each index, the region t_full[index] of the global tensor `t`
# (the model's state-dict entry `name`), lazily, in order (a collective: every rank consumes them
# all). A rank that does not write may get a meta tensor of the region's shape.
RegionGather = Callable[[str, torch.Tensor, list[Index]], Iterator[torch.Tensor]]


def local_regions(name: str, t: torch.Tensor, indices: list[Index]) -> Iterator[torch.Tensor]:
    """The regions of an unsharded tensor."""
    return (t[index] for index in indices)


def gather_whole(regions: RegionGather, name: str, t: torch.Tensor) -> torch.Tensor:
    return next(iter(regions(name, t, [()])))


def hf_pieces(name: str, tensor: torch.Tensor, adapter, regions: RegionGather) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, tensor) for the on-disk tensors the model tensor `name` holds, each gathered
    on its own: for an adapter whose pieces are views (`view_index`), one region at a time;
    otherwise the whole tensor, split by the adapter."""
    whole = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    pieces = adapter.to_hf(name, whole)
    indices = [view_index(whole, piece) for _, piece in pieces]
    if any(i is None for i in indices):
        yield from adapter.to_hf(name, gather_whole(regions, name, tensor))
        return
    for (key, piece), region in zip(pieces, regions(name, tensor, indices), strict=True):
        assert region.shape == piece.shape, (key, region.shape, piece.shape)
        yield key, region


class Source(Protocol):
    """Where the weights come from: `read` returns the part [starts, starts + sizes) of the
    on-disk tensor `key` (whose full shape is `shape`) in `dtype`, on the CPU."""

    def read(self, key: str, shape: tuple[int, ...], starts: tuple[int, ...], sizes: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor: ...


class RandomSource:
    """The seeded random init: normal(0, std) for every matrix, ones for RMSNorm weights. Each
    on-disk tensor is drawn whole, in fp32 on the CPU, from a generator seeded by (seed, key)."""

    def __init__(self, seed: int, std: float) -> None:
        self.seed, self.std = seed, std

    def read(self, key: str, shape: tuple[int, ...], starts: tuple[int, ...], sizes: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
        index = box_index(starts, sizes)
        if key.endswith("norm.weight"):
            return torch.ones(sizes, dtype=dtype)
        if len(shape) < 2:
            raise ValueError(f"no random-init rule for the {len(shape)}-d tensor '{key}'")
        g = torch.Generator().manual_seed(name_seed("titanite-init", self.seed, key))
        return torch.empty(shape).normal_(0.0, self.std, generator=g)[index].to(dtype)


def _entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict key, parameter or buffer) once per tensor: a tied head is its embedding."""
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


@torch.no_grad()
def fill(model: nn.Module, adapter, source: Source) -> int:
    """Copy every parameter and persistent buffer of `model` (materialised, possibly sharded)
    from `source` through the state-dict adapter, reading only this rank's parts. Returns the
    number of on-disk tensors this rank read from."""
    touched = 0
    for name, target in _entries(model):
        if adapter.skips(name):
            continue
        offsets, sizes = local_box(target)
        local = local_part(target)
        whole = torch.empty(target.shape, dtype=target.dtype, device="meta")
        pieces = adapter.to_hf(name, whole)
        if not pieces:  # not in the Hugging Face layout (e.g. the MoE routing bias): the adapter's value
            local.copy_(adapter.from_hf(name, []).to(local.dtype).expand(local.shape))
            continue
        indices = [view_index(whole, piece) for _, piece in pieces]
        if any(i is None for i in indices):  # an adapter whose pieces are not views: whole tensors
            parts = [source.read(k, tuple(p.shape), (0,) * p.ndim, tuple(p.shape), target.dtype) for k, p in pieces]
            local.copy_(adapter.from_hf(name, parts)[box_index(offsets, sizes)])
            touched += len(parts)
            continue
        for (key, piece), index in zip(pieces, indices, strict=True):
            touched += _copy_region(local, offsets, sizes, key, tuple(piece.shape), index, source)
    return touched


def _copy_region(local: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], key: str,
                 shape: tuple[int, ...], index: Index, source: Source) -> int:
    """Copy the part of on-disk tensor `key`, which sits at `index` of the global tensor, that
    falls in this rank's box; 0 when none does."""
    if not index:
        index = tuple(slice(0, n) for n in shape)
    disk_starts, disk_sizes, dst = [], [], []
    for d, ix in enumerate(index):
        lo, hi = (ix, ix + 1) if isinstance(ix, int) else (ix.start, ix.stop)
        lo, hi = max(lo, offsets[d]), min(hi, offsets[d] + sizes[d])
        if lo >= hi:
            return 0
        dst.append(slice(lo - offsets[d], hi - offsets[d]))
        if not isinstance(ix, int):  # a dim of the on-disk tensor
            disk_starts.append(lo - ix.start)
            disk_sizes.append(hi - lo)
    part = source.read(key, shape, tuple(disk_starts), tuple(disk_sizes), local.dtype)
    region = local[tuple(dst)]
    region.copy_(part.reshape(region.shape))
    return 1

"""Context parallelism, the trainer's side: `parallelism.cp` ranks split every sequence.

A data-parallel rank's batch is read by each of its cp ranks alike; `ContextParallel.split`
keeps this rank's two chunks of every row (titanite/kernels/context_parallel.py says which and
why) of the input ids, labels (already shifted by the loader, so a chunk's labels are its own),
position ids and document ids, and the whole row's document ids for the attention masks. The
model then runs on S / cp tokens per row: its attention call sites (wrapped by `apply`) gather
the keys and values of the whole sequence while the micro-batch's layout is active, and MoE
routing statistics are pooled over the cp group. The loss and its token count are summed over
dp x cp ranks (World.all_reduce_sum_loss); FSDP reduces the gradients over dp_shard x cp.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from titanite.kernels import context_parallel
from titanite.kernels.attach import default_impl, iter_kernels

log = logging.getLogger("titanite")
FULL_DOCUMENTS = "cp_document_ids"  # the batch key of the whole rows' document ids


class GroupCollectives:
    """kernels.context_parallel.Collectives over a process group."""

    def __init__(self, group) -> None:
        self.group = group

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

        return wait_tensor(all_gather_single_autograd(rows, gather_dim=0, group=self.group))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(t, group=self.group)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
        return t


def local_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of the sequence that cp rank `rank` holds, in its order: chunks rank and
    2cp-1-rank of 2cp."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


class ContextParallel:
    """The cp group of this rank and the per-micro-batch split and layout."""

    def __init__(self, mesh, seq_len: int) -> None:
        self.collectives = GroupCollectives(mesh.get_group())
        self.cp = mesh.size()
        self.rank = mesh.get_local_rank()
        c = seq_len // (2 * self.cp)
        log.info("context parallel: %d ranks split every %d-token sequence; this rank holds tokens [%d, %d) and "
                 "[%d, %d), and attention gathers the keys and values of the rest", self.cp, seq_len, self.rank * c,
                 (self.rank + 1) * c, (2 * self.cp - 1 - self.rank) * c, (2 * self.cp - self.rank) * c)

    def loader(self, loader: Any) -> SplitLoader:
        """`loader` whose batches come split (before any pinning: the copy to the device then
        starts from pinned memory)."""
        return SplitLoader(loader, self)

    def split(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's share of a host batch of [B, S] tensors (other entries as they are)."""
        S = batch["input_ids"].shape[1]
        if S % (2 * self.cp):
            raise ValueError(f"a batch of {S}-token sequences cannot be cut into 2 x cp = {2 * self.cp} chunks")
        index = local_index(S, self.cp, self.rank)
        out = {k: v.index_select(1, index) if v.dim() == 2 and v.shape[1] == S else v for k, v in batch.items()}
        if "document_ids" in batch:
            out[FULL_DOCUMENTS] = batch["document_ids"]
        return out

    def layout(self, batch: dict[str, torch.Tensor]) -> context_parallel.Layout:
        """The layout of a split (device) batch."""
        rows = batch["input_ids"] if "input_ids" in batch else batch["position_ids"]  # a pipeline stage's: no ids
        S = rows.shape[1] * self.cp
        return context_parallel.Layout(self.collectives, self.cp, self.rank, S, batch.get(FULL_DOCUMENTS))

    @contextlib.contextmanager
    def micro_batch(self, batch: dict[str, torch.Tensor]) -> Iterator[None]:
        """Run one micro-batch's forward and backward in this (the layout of `batch`, a split
        device batch); nested calls for the same micro-batch keep the outer layout."""
        if context_parallel.current() is not None:
            yield
            return
        with context_parallel.active(self.layout(batch)):
            yield


def split(cp: ContextParallel | None, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` as this rank holds it: split under context parallelism, else as it is."""
    return cp.split(batch) if cp is not None else batch


def micro_batch(cp: ContextParallel | None, batch: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
    """The layout of a split device batch, for its forward and backward (nothing without cp)."""
    return cp.micro_batch(batch) if cp is not None else contextlib.nullcontext()


class SplitLoader:
    """A loader whose `next_batch` is this rank's share; everything else is the loader's."""

    def __init__(self, loader: Any, cp: ContextParallel) -> None:
        self.inner, self.cp = loader, cp

    def next_batch(self) -> dict[str, torch.Tensor]:
        return self.cp.split(self.inner.next_batch())

    def __getattr__(self, name: str) -> Any:  # state_dict, data_metrics, seq_len, ...
        return getattr(self.inner, name)


def apply(model: nn.Module, device_type: str, dtype: torch.dtype) -> int:
    """Make every attention call site of `model` context-parallel (around whatever implementation
    it is bound to). Returns how many it wrapped."""
    n = 0
    for _site, _module, kernel in iter_kernels(model):
        if kernel.op != "attention" or hasattr(kernel.fn, "_titanite_context_parallel"):
            continue
        inner = kernel.fn if kernel.fn is not None else default_impl("attention", device_type, dtype).fn
        kernel.fn = context_parallel.wrap(inner)
        n += 1
    return n

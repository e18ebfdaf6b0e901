"""Context-parallel attention: every attention call site, while a sharded sequence is active,
all-gathers the keys and values over the context-parallel ranks and attends each of its query
chunks to the key prefix that chunk may see.

The sequence of S tokens is cut into 2·cp chunks of c = S / (2·cp); rank r holds chunks r and
2cp−1−r (a chunk from the front and its mirror from the back), so under causal attention every
rank attends the same number of query-key pairs: (r + 1) + (2cp − r) = 2cp + 1 chunks of keys
for its two chunks of queries. A plain split (rank r holds chunk r alone) would leave the last
rank cp times the work of the first.

Keys and values are all-gathered (one collective per layer, differentiable: the backward
reduce-scatters their gradients) rather than passed around a ring: with grouped-query attention
they are Hk/Hq of the queries' size (1/4 for Qwen3-4B), the gather is one call where a ring is
cp − 1 dependent steps, and each chunk's attention is then an ordinary call of the `attention`
op with the queries as the last positions of the keys, the shape a KV cache already gives it.
So whichever implementation `[kernels]` binds to the op (sdpa, flex, a device's own) serves
under context parallelism unchanged; the measured share of the gather is in docs/performance.md.

This module keeps the active layout in a module-level slot, set by the trainer around one
micro-batch's forward and backward (titanite/parallel/context.py): activation checkpointing
recomputes attention inside the backward, which an accelerator's autograd engine runs on threads
of its own, where a context variable would read as unset. Outside it (evaluation harnesses,
generation) every call site runs its implementation directly on whole sequences.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor


class Collectives(Protocol):
    """The cp group's collectives, supplied by the parallel layer (titanite/parallel/context.py):
    the model layer, which imports this module, never imports torch.distributed."""

    def gather(self, rows: Tensor) -> Tensor:
        """Concatenate every rank's `rows` along dim 0, in rank order (differentiable: the
        backward reduce-scatters the gradient)."""

    def sum(self, t: Tensor) -> Tensor:
        """`t` summed over the ranks (differentiable: the backward sums the ranks' gradients)."""

    def sum_(self, t: Tensor) -> Tensor:
        """`t` summed over the ranks in place, no gradient."""


@dataclass
class Layout:
    """One micro-batch's split: this rank's two chunks of the sequence, and the document ids of
    the whole sequence (on the device) when samples are packed."""

    collectives: Collectives
    cp: int
    rank: int  # in the cp group
    seq_len: int  # the whole sequence
    document_ids: Tensor | None = None  # int [B, S], the whole sequence
    _prefixes: dict[int, Tensor] = field(default_factory=dict)  # document ids [:, :end], one tensor per end

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)

    def chunk_ends(self) -> tuple[int, int]:
        """End positions (exclusive) of this rank's two chunks in the whole sequence."""
        c = self.chunk
        return (self.rank + 1) * c, (2 * self.cp - self.rank) * c

    def prefix_ids(self, end: int) -> Tensor:
        """The document ids of keys [0, end): the same tensor for every layer of the micro-batch,
        so an implementation that caches a mask per ids tensor builds it once."""
        if end not in self._prefixes:
            self._prefixes[end] = self.document_ids[:, :end]
        return self._prefixes[end]


_active: list[Layout | None] = [None]


@contextlib.contextmanager
def active(layout: Layout | None) -> Iterator[None]:
    """While set, attention call sites wrapped by `wrap` attend over the whole sequence and MoE
    routing statistics are pooled over the cp group."""
    previous = _active[0]
    _active[0] = layout
    try:
        yield
    finally:
        _active[0] = previous


def current() -> Layout | None:
    return _active[0]


def gather_sequence(x: Tensor, layout: Layout) -> Tensor:
    """x: [B, H, S/cp, D], this rank's two chunks -> [B, H, S, D], the whole sequence in order.
    Differentiable: the backward reduce-scatters the gradient back to the ranks' chunks."""
    B, H, local, D = x.shape
    rows = x.permute(2, 0, 1, 3).contiguous()  # [S/cp, B, H, D]: the gather concatenates dim 0
    gathered = layout.collectives.gather(rows)  # [S, B, H, D]
    # Rank r's chunks r and 2cp-1-r: the front halves in rank order, then the back halves in
    # reverse rank order (views and one concatenation; no index tensor to copy to the device).
    chunks = gathered.view(layout.cp, 2, local // 2, B, H, D)
    whole = torch.cat([chunks[:, 0], chunks[:, 1].flip(0)]).view(local * layout.cp, B, H, D)
    return whole.permute(1, 2, 0, 3)


def wrap(fn: Callable) -> Callable:
    """An attention implementation made context-parallel: while a layout is active, q [B, Hq,
    S/cp, D] holds this rank's two chunks and k, v theirs; the keys and values of the whole
    sequence are gathered, and each query chunk attends to the keys up to its own end (the
    queries are the last positions of that prefix: the op's KV-cache form). Packed documents
    pass the prefix's document ids. Without a layout, `fn` itself."""

    def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, document_ids: Tensor | None = None) -> Tensor:
        layout = _active[0]
        if layout is None:
            return fn(q, k, v, scale) if document_ids is None else fn(q, k, v, scale, document_ids=document_ids)
        assert q.shape[2] * layout.cp == layout.seq_len, (q.shape, layout.seq_len, layout.cp)
        keys, values = gather_sequence(k, layout), gather_sequence(v, layout)
        c = layout.chunk
        outs = []
        for j, end in enumerate(layout.chunk_ends()):
            qj = q[:, :, j * c:(j + 1) * c]
            if layout.document_ids is None:
                outs.append(fn(qj, keys[:, :, :end], values[:, :, :end], scale))
            else:
                outs.append(fn(qj, keys[:, :, :end], values[:, :, :end], scale,
                               document_ids=layout.prefix_ids(end)))
        # Concatenated in [B, S, H, D] memory order: the caller's transpose(1, 2).reshape is then
        # a view, not a second copy of the output kept for the backward.
        return torch.cat([o.transpose(1, 2) for o in outs], dim=1).transpose(1, 2)

    attention._titanite_context_parallel = fn  # what `wrap` wrapped (and a mark: already wrapped)
    attention.__name__ = f"context_parallel({getattr(fn, '__name__', 'attention')})"
    return attention


def sum_rows(t: Tensor) -> Tensor:
    """Per-row sums over this rank's chunks (e.g. a sequence's log-probability) -> the whole
    rows', on every cp rank, while a layout is active (differentiably: the backward sums the
    ranks' gradients, so a loss every cp rank computes alike is divided by cp); else `t`."""
    layout = _active[0]
    if layout is None:
        return t
    return layout.collectives.sum(t)


def pool_routing(counts: Tensor, prob_sum: Tensor, num_tokens: int) -> tuple[Tensor, Tensor, int]:
    """MoE routing statistics of this rank's tokens -> those of the whole sequences: summed over
    the cp group while a layout is active (prob_sum differentiably: each rank's share of the
    gradient comes back through the all-reduce's backward), else as they are."""
    layout = _active[0]
    if layout is None:
        return counts, prob_sum, num_tokens
    return layout.collectives.sum_(counts.clone()), layout.collectives.sum(prob_sum), num_tokens * layout.cp

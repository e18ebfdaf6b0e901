"""The `loss` op at a model's head: summed over the batch, or one sum per row.

Every head call site (the native model's untied and tied heads, the transformers head that
kernels/hf.py installs) goes through `head_loss`, so whatever implements `loss` (the chunked
default, a device kernel) serves both reductions. Inside `loss_per_row()` the head returns the
fp32 cross-entropy of each row [B] instead of the batch's sum: what preference training needs
(each sequence's log-probability), without the [B, S, V] logits.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

from titanite.kernels.reference_ops import IGNORE_INDEX

_PER_ROW: contextvars.ContextVar[bool] = contextvars.ContextVar("titanite_loss_per_row", default=False)


@contextlib.contextmanager
def loss_per_row() -> Iterator[None]:
    """While set, head_loss returns one summed cross-entropy per row."""
    token = _PER_ROW.set(True)
    try:
        yield
    finally:
        _PER_ROW.reset(token)


def head_loss(loss: Callable[..., torch.Tensor], h: torch.Tensor, weight: torch.Tensor,
              labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of `labels` [B, S] (IGNORE_INDEX skipped) from hidden states h [B, S, H] and
    the head `weight` [V, H] through the `loss` op: fp32, summed (a scalar), or per row ([B])
    inside loss_per_row()."""
    if _PER_ROW.get():
        rows = h.reshape(*labels.shape, h.shape[-1])
        return torch.stack([loss(rows[r], weight, labels[r], IGNORE_INDEX) for r in range(labels.shape[0])])
    return loss(h.flatten(0, -2), weight, labels.flatten(), IGNORE_INDEX)

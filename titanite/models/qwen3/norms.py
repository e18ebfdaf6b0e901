"""The RMSNorms of the native models: Qwen3's `w * x`, and the zero-centred `(1 + w) * x` of
Qwen3.5 and Qwen3-Next, chosen per architecture by `make_norm`. Both go through the `rms_norm` op."""

from __future__ import annotations

import torch
from torch import nn

from titanite import kernels
from titanite.models.qwen3.args import Qwen3Args


class RMSNorm(nn.Module):
    """weight [D] (ones at init) * RMSNorm(x) over the last dim; x: [..., D]."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = kernels.op("rms_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


class ZeroCentredRMSNorm(RMSNorm):
    """(1 + weight [D]) * RMSNorm(x), weight zeros at init: Qwen3.5 / Qwen3-Next decoder norms.

    x: [..., D] any float dtype -> same dtype. Normalised and scaled in fp32 before the one cast
    back, as transformers computes it: a bf16 `1 + w` would round w away (bf16 steps are 2^-7
    near 1, larger than a trained w often is)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)


def make_norm(a: Qwen3Args, dim: int) -> RMSNorm:
    """The architecture's RMSNorm over `dim`."""
    return ZeroCentredRMSNorm(dim, a.rms_norm_eps) if a.zero_centred_norms else RMSNorm(dim, a.rms_norm_eps)

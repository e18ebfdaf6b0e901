"""A kernel plugin for the device tests: an `rms_norm` implementation declared for the test
device `tdev` only (it computes the reference; what is tested is where the registry lets it run)."""

from __future__ import annotations

import torch

import titanite

_reference = titanite.kernels.reference("rms_norm")


@titanite.kernels.register("rms_norm", "tdev_rms_norm", devices=("tdev",))
def tdev_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _reference(x, weight, eps)

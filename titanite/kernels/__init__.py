"""Kernel seams: the native model reaches its replaceable math only through named ops.

Ops: attention, rms_norm, rope, swiglu, moe.router, moe.dispatch, moe.experts, loss. Each has a
pure-PyTorch reference in `titanite.kernels.reference_ops` (`reference(op)` returns it); other
implementations register against the same signature:

    @titanite.kernels.register("moe.experts", "my_kernel", devices=("cuda",), dtypes=(torch.bfloat16,))
    def my_experts(x, counts, w_gate_up, w_down): ...

A module binds a call site with `op(name)`; `attach(model, ...)` rebinds every call site from
the `[kernels]` table (per op, or per module FQN glob). `titanite kernels list|verify|bench`
shows, checks and times what is registered.
"""

from __future__ import annotations

# The built-in implementations register themselves on import. Importing any module of this
# package runs this file first, so every path to the registry sees them. Modules inside the
# package import the module that holds a name (`titanite.kernels.registry`), never this file, so
# importing them here makes no circle.
from titanite.kernels import chunked_loss, fla_impls, torch_impls  # noqa: F401
from titanite.kernels.attach import DEFAULTS, Kernel, attach, iter_kernels
from titanite.kernels.head_loss import head_loss, loss_per_row
from titanite.kernels.plugins import load_plugins
from titanite.kernels.reference_ops import IGNORE_INDEX, block_causal_mask
from titanite.kernels.registry import OPS, REFERENCE, Impl, implementations, reference, register
from titanite.kernels.triton import delta_ops as triton_delta_ops  # noqa: F401
from titanite.kernels.triton import ops as triton_ops  # noqa: F401

__all__ = ["DEFAULTS", "IGNORE_INDEX", "OPS", "REFERENCE", "Impl", "Kernel", "attach", "block_causal_mask",
           "head_loss", "implementations", "iter_kernels", "load_plugins", "loss_per_row", "op", "reference",
           "register"]


def op(name: str) -> Kernel:
    """A call site for op `name`, for a module to hold (`self.kernel = kernels.op("rms_norm")`)."""
    return Kernel(name)

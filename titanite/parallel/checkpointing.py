"""Activation checkpointing and torch.compile, applied per transformer block from outside.

Both replace the block's `forward` on the instance rather than wrapping the module, so parameter
names (and with them checkpoints and Hugging Face exports) do not change, and FSDP's hooks on
the block's `__call__` stay outside the recomputed and compiled region.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titanite.device.choice import compile_backend
from titanite.kernels import context_parallel

# Outputs worth keeping under selective checkpointing: the matmuls and attention, whose
# recomputation costs FLOPs. Everything else in a block (norms, RoPE, SiLU, residual adds) is
# cheap elementwise work and is recomputed instead of stored.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._grouped_mm.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: str) -> None:
    """mode: 'none', 'full' (keep each block's inputs only) or 'selective' (see _SAVE_OPS)."""
    if mode == "none":
        return
    assert mode in ("full", "selective"), mode
    for block in blocks:
        inner = block.forward
        kw = {"context_fn": _selective_context} if mode == "selective" else {}

        @functools.wraps(inner)
        def forward(*args, _inner=inner, _kw=kw, **kwargs):
            # The recomputation in backward runs under the forward's context-parallel layout:
            # under pipeline parallelism another micro-batch's may be active by then.
            layout = context_parallel.current()

            def run(*a, **k):
                with context_parallel.active(layout):
                    return _inner(*a, **k)

            return checkpoint(run, *args, use_reentrant=False, **_kw, **kwargs)

        block.forward = forward


def apply_compile(blocks: Iterable[nn.Module], device: torch.device) -> None:
    """torch.compile each block's forward (after checkpointing, so recomputation is compiled too),
    with the backend the device supports (titanite.device.choice.compile_backend)."""
    backend = compile_backend(device)
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=False, backend=backend)

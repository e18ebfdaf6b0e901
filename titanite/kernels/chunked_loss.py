"""`loss` = "chunked": final linear + cross-entropy that never holds the [N, V] logits.

Forward walks the tokens in chunks: logits of one chunk, their log-sum-exp (kept: fp32 [N]) and
the label logit, then the chunk's logits are dropped. Backward recomputes each chunk's logits,
turns them into softmax - onehot with the saved log-sum-exp, and accumulates the hidden and
weight gradients. Peak extra memory is one chunk of logits (about _CHUNK_ELEMENTS fp32 values)
instead of N x V, for one extra head matmul in backward. Pure PyTorch: runs on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titanite.kernels.reference_ops import IGNORE_INDEX
from titanite.kernels.registry import register
from titanite.kernels.torch_impls import compute_dtype

# Logit elements per chunk: 2**26 fp32 values = 256 MiB; 441 tokens for Qwen3's 151,936 rows.
_CHUNK_ELEMENTS = 1 << 26


def chunk_rows(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // vocab)


@torch.library.custom_op("titanite::linear_cross_entropy_chunked", mutates_args=())
def _forward(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk: int) -> tuple[Tensor, Tensor]:
    """Returns (summed loss fp32 [], log-sum-exp fp32 [N])."""
    N = hidden.shape[0]
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
    for s in range(0, N, chunk):
        logits = (hidden[s:s + chunk] @ weight.t()).float()  # [c, V]
        lse_c = torch.logsumexp(logits, dim=-1)
        lab = labels[s:s + chunk]
        valid = lab != ignore_index
        target = logits.gather(1, torch.where(valid, lab, 0).unsqueeze(1)).squeeze(1)
        loss += torch.where(valid, lse_c - target, 0.0).sum()
        lse[s:s + chunk] = lse_c
    return loss, lse


@_forward.register_fake
def _(hidden, weight, labels, ignore_index, chunk):
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape[0], dtype=torch.float32)


@torch.library.custom_op("titanite::linear_cross_entropy_chunked_backward", mutates_args=())
def _backward_op(grad: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, ignore_index: int,
                 chunk: int) -> tuple[Tensor, Tensor]:
    """Returns (d hidden [N, H], d weight [V, H]) for d loss = grad (fp32 scalar)."""
    N = hidden.shape[0]
    d_hidden = torch.empty_like(hidden)
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for s in range(0, N, chunk):
        h = hidden[s:s + chunk]
        lab = labels[s:s + chunk]
        valid = lab != ignore_index
        # In place from here on: one [c, V] fp32 buffer becomes softmax - onehot, then d logits.
        d_logits = (h @ weight.t()).float().sub_(lse[s:s + chunk, None]).exp_()
        rows = torch.arange(lab.shape[0], device=lab.device)
        d_logits[rows, torch.where(valid, lab, 0)] -= valid.to(d_logits.dtype)
        d_logits = d_logits.mul_(valid.unsqueeze(1) * grad).to(hidden.dtype)
        d_hidden[s:s + chunk] = d_logits @ weight
        if d_logits.dtype == torch.float32:
            d_weight.addmm_(d_logits.t(), h)  # no [V, H] temporary
        else:  # accumulate in fp32 across chunks; the product is a 16-bit temporary
            d_weight.add_(d_logits.t() @ h)
    return d_hidden, d_weight.to(weight.dtype)


@_backward_op.register_fake
def _(grad, hidden, weight, labels, lse, ignore_index, chunk):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    hidden, weight, labels, ignore_index, chunk = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(hidden, weight, labels, output[1])
    ctx.ignore_index, ctx.chunk = ignore_index, chunk


def _backward(ctx, grad, _dlse):
    hidden, weight, labels, lse = ctx.saved_tensors
    d_hidden, d_weight = torch.ops.titanite.linear_cross_entropy_chunked_backward(
        grad, hidden, weight, labels, lse, ctx.ignore_index, ctx.chunk)
    return d_hidden, d_weight, None, None, None


_forward.register_autograd(_backward, setup_context=_setup)


@register("loss", "chunked")
def chunked(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Summed cross-entropy of hidden @ weight^T against labels, chunk by chunk over tokens."""
    dtype = compute_dtype(hidden, weight)
    loss, _ = torch.ops.titanite.linear_cross_entropy_chunked(hidden.to(dtype), weight.to(dtype), labels,
                                                              int(ignore_index), chunk_rows(weight.shape[0]))
    return loss

"""The chunked gated delta rule's Triton kernels as `torch.library` custom ops (fake + autograd),
registered as implementation `triton` of `gated_delta`.

The custom op takes a state (zeros when the caller has none) and a per-token reset flag instead
of document ids, so its schema has no optional tensors and the wrapper needs no host sync. The
forward keeps nothing beyond its inputs: the backward re-runs the forward scan for the states
at the chunk starts (B * Hv * ceil(S / 64) * Dk * Dv fp32 while it runs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from titanite.kernels.registry import register
from titanite.kernels.triton.availability import COMPILED_ON, INTERPRETED_ON, unavailable_dot

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@torch.library.custom_op("titanite::gated_delta_triton", mutates_args=())
def _gated_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, h0: Tensor,
                 reset: Tensor) -> tuple[Tensor, Tensor]:
    import titanite.kernels.triton.gated_delta as kernels

    o, ht, _ = kernels.forward(*(t.contiguous() for t in (q, k, v, g, beta)), scale, h0.contiguous(),
                               reset.contiguous())
    return o, ht


@_gated_delta.register_fake
def _(q, k, v, g, beta, scale, h0, reset):
    return torch.empty_like(v, memory_format=torch.contiguous_format), torch.empty_like(h0, dtype=torch.float32)


@torch.library.custom_op("titanite::gated_delta_triton_backward", mutates_args=())
def _gated_delta_backward(do: Tensor, dht: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          scale: float, h0: Tensor, reset: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    import titanite.kernels.triton.gated_delta as kernels

    return kernels.backward(do.contiguous(), dht.float().contiguous(), *(t.contiguous() for t in (q, k, v, g, beta)),
                            scale, h0.contiguous(), reset.contiguous())


@_gated_delta_backward.register_fake
def _(do, dht, q, k, v, g, beta, scale, h0, reset):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, g, beta)) + \
        (torch.empty_like(h0, dtype=torch.float32),)


def _setup(ctx, inputs, output):
    q, k, v, g, beta, scale, h0, reset = inputs
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, g, beta, h0, reset)


def _bwd(ctx, do, dht):
    q, k, v, g, beta, h0, reset = ctx.saved_tensors
    # An output that no loss reached may come as None (e.g. the final state, under torch.compile).
    do = torch.zeros_like(v) if do is None else do
    dht = torch.zeros_like(h0, dtype=torch.float32) if dht is None else dht
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.titanite.gated_delta_triton_backward(do, dht, q, k, v, g, beta, ctx.scale,
                                                                                 h0, reset)
    return dq, dk, dv, dg, dbeta, None, dh0.to(h0.dtype), None


_gated_delta.register_autograd(_bwd, setup_context=_setup)


def reset_flags(document_ids: Tensor | None, B: int, S: int, device: torch.device) -> Tensor:
    """int32 [B, S]: 1 where a document starts, except at t = 0 (a row starts from its initial state)."""
    if document_ids is None:
        return torch.zeros(B, S, dtype=torch.int32, device=device)
    return F.pad(document_ids[:, 1:] != document_ids[:, :-1], (1, 0)).to(torch.int32)


@register("gated_delta", "triton", devices=COMPILED_ON + INTERPRETED_ON, dtypes=_FLOATS, requires=unavailable_dot)
def gated_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                initial_state: Tensor | None = None, document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The chunked gated delta rule in Triton (fp32 math), forward and backward; the reference's
    semantics, document restarts by a per-token reset flag (no host sync)."""
    B, S, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    assert Hv % Hk == 0, f"gated_delta: {Hv} value heads are no multiple of {Hk} key heads"
    h0 = (torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32, device=v.device) if initial_state is None
          else initial_state.float())
    reset = reset_flags(document_ids, B, S, v.device)
    return torch.ops.titanite.gated_delta_triton(q, k, v, g, beta, float(scale), h0, reset)

"""fla-core's chunked gated delta rule (flash-linear-attention's Triton kernels) as implementation
`fla` of `gated_delta`, for CUDA. fla-core is optional: imported only when the kernel runs.

Packed documents become fla's variable-length form: the rows flattened into one sequence cut at
every document and row boundary (`cu_seqlens`, a host sync), a row's first segment starting from
its initial state and the others from zeros; a row's final state is its last segment's.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

from titanite.kernels.reference_delta import segment_starts
from titanite.kernels.registry import register


DEVICES = ("cuda",)


def _unavailable(device_type: str, dtype: torch.dtype | None) -> str | None:
    """Why fla-core cannot run here (the registry has already ruled out devices other than CUDA)."""
    if device_type not in DEVICES:
        return ("fla-core's Triton kernels need a CUDA driver: on CPU, even under TRITON_INTERPRET=1, "
                "they stop with 'RuntimeError: 0 active drivers'")
    if importlib.util.find_spec("fla") is None:
        return "needs fla-core, whose Triton kernels need a CUDA GPU (pip install fla-core)"
    return None


@register("gated_delta", "fla", devices=DEVICES, dtypes=(torch.float32, torch.float16, torch.bfloat16),
          requires=_unavailable)
def gated_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                initial_state: Tensor | None = None, document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule with the reference's semantics (GQA: fla's
    grouped value heads, the same layout)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, S, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if document_ids is None:
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=True)
        return o.to(v.dtype), final.float()
    starts = segment_starts(document_ids)
    cu_seqlens = F.pad(starts, (0, 1), value=B * S)
    row = starts // S
    first = F.pad(row[1:] != row[:-1], (1, 0), value=True)
    last = F.pad(row[1:] != row[:-1], (0, 1), value=True)
    h0 = (torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32, device=v.device) if initial_state is None
          else initial_state.float())
    h0 = h0[row] * first[:, None, None, None]
    o, final = chunk_gated_delta_rule(*(t.reshape(1, B * S, *t.shape[2:]) for t in (q, k, v, g, beta)), scale=scale,
                                      initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    return o.reshape(B, S, Hv, Dv).to(v.dtype), final[last].float()

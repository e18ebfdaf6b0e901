"""The Gated DeltaNet ops inside transformers' Qwen3.5 and Qwen3-Next models (`model.spec = "hf"`).

transformers' pure-PyTorch path for these layers ignores packed documents: its attention
honours them, but its short convolution and its recurrence run straight across a document
boundary, so one document's tokens leak into the next. titanite replaces the *instance* forward
of each Gated DeltaNet module (the class is untouched) with the same math through the
`short_conv`, `gated_delta` and `rms_norm_gated` ops, given the document ids that titanite's
forward passes to every layer (`DOCUMENTS_KWARG`). The state and the convolution window restart
at every document, as in the native model, and one `[kernels]` selection serves both backends.

Decoding with transformers' cache (its conv and recurrent states) keeps transformers' own code.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from titanite.kernels.attach import Kernel

DOCUMENTS_KWARG = "titanite_document_ids"  # how titanite's forward hands every layer its document ids


def _classes() -> tuple[type, ...]:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as dense
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe
    from transformers.models.qwen3_next import modeling_qwen3_next as next_

    return dense.Qwen3_5GatedDeltaNet, moe.Qwen3_5MoeGatedDeltaNet, next_.Qwen3NextGatedDeltaNet


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' (and fla's) L2 norm over the head dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _projections(self: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mixed q|k|v [B, S, 2 Hk Dk + Hv Dv], z [B, S, Hv, Dv], b [B, S, Hv], a [B, S, Hv]).
    Qwen3.5 projects each separately; Qwen3-Next fuses them head-interleaved."""
    B, S, _ = x.shape
    if hasattr(self, "in_proj_qkvz"):
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(x), self.in_proj_ba(x))
        return torch.cat([t.reshape(B, S, -1) for t in (q, k, v)], dim=-1), z, b, a
    z = self.in_proj_z(x).reshape(B, S, -1, self.head_v_dim)
    return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


def _delta_forward(self: nn.Module, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """transformers' Gated DeltaNet through the ops: [B, S, H] -> [B, S, H]."""
    if cache is not None:  # decoding: transformers keeps its conv and recurrent states
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    documents = kwargs.get(DOCUMENTS_KWARG)
    B, S, _ = hidden_states.shape
    mixed, z, b, a = _projections(self, hidden_states)
    mixed = self.short_conv(mixed, self.conv1d.weight.squeeze(1), documents)  # [B, S, C]
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = _l2norm(q.reshape(B, S, -1, self.head_k_dim))
    k = _l2norm(k.reshape(B, S, -1, self.head_k_dim))
    v = v.reshape(B, S, -1, self.head_v_dim)
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [B, S, Hv], fp32
    out, _ = self.gated_delta(q, k, v, g, b.sigmoid(), self.head_k_dim ** -0.5, None, documents)
    out = out.to(hidden_states.dtype)
    out = self.norm_gated(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim), self.norm.weight,
                          self.norm.variance_epsilon)
    return self.out_proj(out.reshape(B, S, -1))


def install_delta(hf: nn.Module) -> int:
    """Give every Gated DeltaNet module of a transformers model the three call sites; returns
    how many."""
    classes = _classes()
    found = 0
    for module in hf.modules():
        if isinstance(module, classes):
            module.short_conv = Kernel("short_conv")
            module.gated_delta = Kernel("gated_delta")
            module.norm_gated = Kernel("rms_norm_gated")
            module.forward = types.MethodType(_delta_forward, module)
            found += 1
    return found

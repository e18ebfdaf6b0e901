"""The token mixers of Qwen3.5 and Qwen3-Next: Gated DeltaNet (linear attention) and gated full
attention. `TransformerBlock` (model.py) picks one per layer from `Qwen3Args.layer_types`.

Shapes: B batch, S sequence, H hidden; full attention: Hq/Hk query/key-value heads, D head_dim,
R rotary dims (D x partial_rotary_factor); Gated DeltaNet: Hk/Hv key/value heads (each key head
serves Hv / Hk consecutive value heads), Dk/Dv their widths, C = 2 Hk Dk + Hv Dv conv channels,
K the conv kernel. The math goes through the `gated_delta`, `short_conv`, `rms_norm_gated`,
`rope` and `attention` kernel ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanite import kernels
from titanite.models.qwen3.args import Qwen3Args
from titanite.models.qwen3.kv_cache import DeltaLayerCache, LayerCache
from titanite.models.qwen3.norms import make_norm


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (transformers' and fla's l2norm)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """weight [Dv] (ones at init, not zero-centred) * RMSNorm(x) * silu(gate), per value head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = kernels.op("rms_norm_gated")

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., Dv] -> [..., Dv] in x's dtype."""
        return self.kernel(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet: causal conv + SiLU over q|k|v, L2-normed q and k, the gated delta rule
    with decay g = -exp(A_log) softplus(a + dt_bias) (fp32) and write strength beta = sigmoid(b),
    then a per-head gated RMSNorm with gate z, and the output projection.

    Weights: w_qkvz [2 Hk Dk + 2 Hv Dv, H] (rows: q | k | v | z, each head-major), w_ba [2 Hv, H]
    (rows: b | a), conv_weight [C, K] (tap K-1 is the current token), A_log [Hv], dt_bias [Hv],
    norm.weight [Dv], wo [H, Hv Dv]. Qwen3.5 stores the projections in these blocks; Qwen3-Next
    interleaves them per key head (hybrid_state_dict.py converts, exactly)."""

    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.key_heads, self.value_heads = a.linear_num_key_heads, a.linear_num_value_heads
        self.key_dim, self.value_dim = a.linear_key_head_dim, a.linear_value_head_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.splits = (keys, keys, values)  # q | k | v: the conv's channels
        self.w_qkvz = nn.Linear(a.hidden_size, 2 * keys + 2 * values, bias=False)
        self.w_ba = nn.Linear(a.hidden_size, 2 * self.value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(2 * keys + values, a.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(self.value_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, a.rms_norm_eps)
        self.wo = nn.Linear(values, a.hidden_size, bias=False)
        self.conv = kernels.op("short_conv")
        self.delta = kernels.op("gated_delta")

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, kv_cache: DeltaLayerCache | None = None) -> torch.Tensor:
        """x: [B, S, H] -> [B, S, H]. cos/sin are unused: the recurrence orders the tokens.
        document_ids: int64 [B, S] of packed samples: the conv window and the state restart at
        each. kv_cache (decoding, no document_ids): the S tokens continue the cached conv window
        and recurrent state, which then move past them."""
        B, S, _ = x.shape
        qkv, z = self.w_qkvz(x).split([sum(self.splits), self.value_heads * self.value_dim], dim=-1)
        b, a = self.w_ba(x).chunk(2, dim=-1)  # [B, S, Hv] each
        if kv_cache is None:
            mixed = self.conv(qkv, self.conv_weight, document_ids)  # [B, S, C]
        else:  # the conv over the cached window + the new tokens; the window's outputs are not new
            mixed = self.conv(kv_cache.extend(qkv), self.conv_weight)[:, -S:]
        q, k, v = mixed.split(self.splits, dim=-1)
        q = l2norm(q.view(B, S, -1, self.key_dim))  # [B, S, Hk, Dk] fp32
        k = l2norm(k.view(B, S, -1, self.key_dim))
        v = v.view(B, S, -1, self.value_dim)  # [B, S, Hv, Dv]
        # In fp32: in bf16, exp(A_log) of a large A_log and softplus near 0 lose the decay.
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [B, S, Hv]
        initial = None if kv_cache is None else kv_cache.state  # None at prefill: zeros, as in training
        out, state = self.delta(q, k, v, g, b.sigmoid(), self.key_dim ** -0.5, initial, document_ids)
        if kv_cache is not None:
            kv_cache.state = state  # [B, Hv, Dk, Dv] fp32
        out = self.norm(out, z.view(B, S, -1, self.value_dim))  # [B, S, Hv, Dv]
        return self.wo(out.reshape(B, S, -1))

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """The conv like a matrix; A = exp(A_log) uniform in [0.01, 16] (kept away from 0, so
        A_log is finite) and dt_bias 1, as transformers initialises them. The projections and
        the norm are initialised as every Linear and norm is (Qwen3.init_weights)."""
        nn.init.normal_(self.conv_weight, mean=0.0, std=std)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())
        nn.init.ones_(self.dt_bias)


class GatedAttention(nn.Module):
    """Qwen3.5 / Qwen3-Next full attention: Qwen3's GQA with q/k norms before RoPE, plus an
    output gate from q_proj and RoPE on the first R dims of each head only.

    wq [2 Hq D, H] holds, head by head, D query rows then D gate rows (transformers' q_proj
    layout, so a head-wise split keeps a head's query and gate together); wk, wv [Hk D, H];
    wo [H, Hq D]."""

    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = a.head_dim, a.rotary_dim
        self.wq = nn.Linear(a.hidden_size, 2 * a.num_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = make_norm(a, a.head_dim)
        self.k_norm = make_norm(a, a.head_dim)
        self.rope = kernels.op("rope")
        self.attend = kernels.op("attention")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: torch.Tensor | None = None, kv_cache: LayerCache | None = None) -> torch.Tensor:
        """x: [B, S, H]; cos, sin: [B, S, R] -> [B, S, H]. document_ids: int64 [B, S] of packed
        samples (block-causal attention). With kv_cache (decoding) the S new positions extend the
        cached keys and values and attend over all of them."""
        B, S, _ = x.shape
        D, R = self.head_dim, self.rotary_dim
        q, gate = self.wq(x).view(B, S, -1, 2 * D).chunk(2, dim=-1)  # [B, S, Hq, D] each
        q = self.q_norm(q).transpose(1, 2)  # [B, Hq, S, D]
        k = self.k_norm(self.wk(x).view(B, S, -1, D)).transpose(1, 2)  # [B, Hk, S, D]
        v = self.wv(x).view(B, S, -1, D).transpose(1, 2)
        q_rot, k_rot = self.rope(q[..., :R].contiguous(), k[..., :R].contiguous(), cos, sin)
        q, k = torch.cat((q_rot, q[..., R:]), dim=-1), torch.cat((k_rot, k[..., R:]), dim=-1)
        if kv_cache is not None:
            k, v = kv_cache.extend(k, v)  # [B, Hk, cached + S, D]
        if document_ids is None:
            out = self.attend(q, k, v, D ** -0.5)  # [B, Hq, S, D]
        else:
            out = self.attend(q, k, v, D ** -0.5, document_ids=document_ids)
        out = out.transpose(1, 2).reshape(B, S, -1) * torch.sigmoid(gate.reshape(B, S, -1))
        return self.wo(out)

"""Native Qwen3: single-device, plain PyTorch. Parallelism is applied from outside.

Shapes: B batch, S sequence, H hidden, Hq/Hk query/key-value heads, D head_dim, V vocab.
Replaceable math (norms, RoPE, attention, SwiGLU, MoE routing, dispatch and experts, the loss)
goes through `titanite.kernels.op` call sites, bound from `[kernels]` by `kernels.attach`.

Qwen3.5 and Qwen3-Next are the same decoder with other blocks chosen from `Qwen3Args`: Gated
DeltaNet or gated full attention per layer (hybrid.py), zero-centred norms (norms.py), and a
shared expert beside the routed ones (moe.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from titanite import kernels
from titanite.models.qwen3.args import Qwen3Args
from titanite.models.qwen3.hybrid import GatedAttention, GatedDeltaNet, GatedRMSNorm
from titanite.models.qwen3.kv_cache import DeltaLayerCache, KVCache, LayerCache
from titanite.models.qwen3.moe import GroupedExperts, MoE, TopKRouter
from titanite.models.qwen3.norms import RMSNorm, ZeroCentredRMSNorm, make_norm
from titanite.models.stage import Part


class RotaryEmbedding(nn.Module):
    """cos/sin for given positions, as transformers' Qwen3 rotary embedding computes them with
    its RoPE types (modeling_rope_utils): `inv_freq` from rope_theta and the scaling (linear and
    YaRN scale it; dynamic NTK grows theta with the longest position of each forward), and cos/sin
    times YaRN's attention factor (1 otherwise). `inv_freq` is a non-persistent buffer, recomputed
    by `reset_parameters` after meta-device init (to_empty leaves it as garbage). With partial
    RoPE (Qwen3.5, Qwen3-Next) the frequencies span the rotary dims only: `head_dim` below is
    Qwen3Args.rotary_dim."""

    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = a.rotary_dim, a.rope_theta, a.rope_scaling
        self.max_positions = a.max_position_embeddings  # dynamic: the length it starts to grow theta at
        inv_freq, self.attention_scaling = self._frequencies()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _exponents(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim  # [D/2]

    def _frequencies(self) -> tuple[torch.Tensor, float]:
        """(inv_freq [D/2] fp32, cos/sin scale) at the model's own length."""
        s, D = self.scaling, self.head_dim
        if s is None:
            return 1.0 / (self.theta ** self._exponents()), 1.0
        if s.rope_type == "linear":  # positions / factor, applied to the frequencies instead
            return 1.0 / (self.theta ** self._exponents()) / s.factor, 1.0
        if s.rope_type == "dynamic":  # theta grown for max_positions itself, i.e. unchanged
            n = self.max_positions
            base = self.theta * ((s.factor * n / n) - (s.factor - 1)) ** (D / (D - 2))
            return 1.0 / (base ** self._exponents()), 1.0
        return self._yarn()

    def _yarn(self) -> tuple[torch.Tensor, float]:
        """YaRN: frequencies that turn fewer than beta_slow times over the original length are
        interpolated (divided by factor), those that turn more than beta_fast times are kept,
        with a linear ramp over the dimensions between; cos/sin are scaled by attention_factor."""
        s, D, theta = self.scaling, self.head_dim, self.theta
        original = s.original_max_position_embeddings

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = s.attention_factor
        if attention is None:
            attention = (float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
                         if s.mscale and s.mscale_all_dim else mscale(s.factor))

        def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
            return (D * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = dimension(s.beta_fast or 32), dimension(s.beta_slow or 1)
        if s.truncate is None or s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, D - 1)
        if low == high:
            high += 0.001  # no division by zero
        ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
        powers = theta ** self._exponents()
        extrapolated, interpolated = 1.0 / powers, 1.0 / (s.factor * powers)
        keep = 1 - ramp  # the share of each dimension's original frequency
        return interpolated * (1 - keep) + extrapolated * keep, attention

    def reset_parameters(self) -> None:
        # Reassigned, not copied into: it stays fp32 even after model.to(bfloat16).
        self.inv_freq = self._frequencies()[0].to(self.inv_freq.device)

    def _dynamic_inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK: past max_positions, theta grows with this forward's length (the largest
        position + 1), on the device, without a host sync. transformers' module also remembers
        the longest length it has seen until a shorter-than-max_positions one comes; a forward
        here depends only on its own positions, as in a freshly loaded transformers model."""
        s, D, n = self.scaling, self.head_dim, self.max_positions
        length = position_ids.max() + 1
        grown_to = torch.maximum(length, torch.tensor(n, dtype=length.dtype, device=length.device))
        base = self.theta * ((s.factor * grown_to / n) - (s.factor - 1)) ** (D / (D - 2))
        grown = 1.0 / (base ** self._exponents(position_ids.device))
        return torch.where(length > n, grown, self.inv_freq)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.scaling is not None and self.scaling.rope_type == "dynamic"
        inv_freq = self._dynamic_inv_freq(position_ids) if dynamic else self.inv_freq
        freqs = position_ids[..., None].float() * inv_freq  # [B, S, D/2], fp32
        angles = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
        return (angles.cos() * self.attention_scaling).to(dtype), (angles.sin() * self.attention_scaling).to(dtype)


class Attention(nn.Module):
    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.wq = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        # Qwen3 normalises each head over head_dim, before RoPE.
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.rope = kernels.op("rope")
        self.attend = kernels.op("attention")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: torch.Tensor | None = None, kv_cache: LayerCache | None = None) -> torch.Tensor:
        """x: [B, S, H] -> [B, S, H]. With kv_cache (decoding) the S new positions extend the
        cached keys and values and attend over all of them."""
        B, S, _ = x.shape
        # Heads from the weights' sizes, so a tensor-parallel shard sees its local head count.
        q = self.q_norm(self.wq(x).view(B, S, -1, self.head_dim)).transpose(1, 2)  # [B, Hq, S, D]
        k = self.k_norm(self.wk(x).view(B, S, -1, self.head_dim)).transpose(1, 2)  # [B, Hk, S, D]
        v = self.wv(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # [B, Hk, S, D]
        q, k = self.rope(q, k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.extend(k, v)  # [B, Hk, cached + S, D]
        if document_ids is None:  # one causal sequence per row
            out = self.attend(q, k, v, self.head_dim ** -0.5)  # [B, Hq, S, D]
        else:  # packed samples: block-causal
            out = self.attend(q, k, v, self.head_dim ** -0.5, document_ids=document_ids)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x). w1 = gate, w3 = up, w2 = down."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.swiglu = kernels.op("swiglu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.swiglu(self.w1(x), self.w3(x)))


class OutputHead(nn.Linear):
    """The untied output projection [V, H]. With labels it returns the summed cross-entropy
    through the `loss` op (by default chunked: the [N, V] logits are never held), computed
    inside this module's forward so that FSDP's hooks gather its weight as for the logits."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__(hidden, vocab, bias=False)
        self.loss = kernels.op("loss")

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        return kernels.head_loss(self.loss, h, self.weight, labels)


def token_mixer(a: Qwen3Args, layer_id: int) -> nn.Module:
    """Qwen3's attention, or for Qwen3.5 / Qwen3-Next the layer's type: Gated DeltaNet on
    "linear_attention" layers, gated full attention on the others."""
    if a.layer_is_linear(layer_id):
        return GatedDeltaNet(a)
    return GatedAttention(a) if a.attn_output_gate else Attention(a)


class TransformerBlock(nn.Module):
    def __init__(self, a: Qwen3Args, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = make_norm(a, a.hidden_size)
        self.attention = token_mixer(a, layer_id)
        self.ffn_norm = make_norm(a, a.hidden_size)
        # Qwen3-MoE keeps some layers dense (mlp_only_layers, decoder_sparse_step).
        shared = (FeedForward(a.hidden_size, a.shared_expert_intermediate_size)
                  if a.shared_expert_intermediate_size else None)
        self.feed_forward = (MoE(a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_experts_per_tok,
                                 a.norm_topk_prob, shared_expert=shared)
                             if a.layer_is_moe(layer_id) else FeedForward(a.hidden_size, a.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: torch.Tensor | None = None,
                kv_cache: LayerCache | DeltaLayerCache | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, document_ids, kv_cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Qwen3(nn.Module):
    """Decoder-only Qwen3. With tied embeddings there is no `output` module: the head reuses
    `tok_embeddings.weight`, so the tie can never be split (by to_empty, FSDP or a loader)."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.rotary = RotaryEmbedding(args)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.num_layers))
        self.norm = make_norm(args, args.hidden_size)
        self.output = None if args.tie_word_embeddings else OutputHead(args.hidden_size, args.vocab_size)
        # The tied head's loss call site (an untied head, OutputHead, has its own).
        self.loss = kernels.op("loss") if self.output is None else None

    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """input_ids: [B, S] int64 -> final normed hidden states [B, S, H].

        document_ids: optional int64 [B, S] marking packed samples; attention stays inside each
        (position_ids should then restart at 0 for each sample). kv_cache: decoding; the
        tokens continue the cached sequence (position_ids must say where; the caller advances
        the cache afterwards)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        h = self.tok_embeddings(input_ids)
        cos, sin = self.rotary(position_ids, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, document_ids, None if kv_cache is None else kv_cache.layer(i))
        return self.norm(h)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                part: Part | None = None) -> torch.Tensor:
        """input_ids: [B, S] int64 -> logits [B, S, V]. document_ids: see hidden_states.

        With labels (int64 [B, S]): the fp32 cross-entropy summed over tokens whose label is not
        kernels.IGNORE_INDEX, through the `loss` op, instead of the logits (per row [B] inside
        kernels.loss_per_row()).

        part: run only these blocks (a pipeline stage): `input_ids` is then the previous part's
        hidden states [B, S, H] unless the part is the first, and the output is the hidden states
        after its last block unless it is the last."""
        if part is not None:
            h = self.tok_embeddings(input_ids) if part.first else input_ids
            if position_ids is None:
                position_ids = torch.arange(h.shape[1], device=h.device).expand(h.shape[:2])
            cos, sin = self.rotary(position_ids, h.dtype)
            for i in part.layers:
                h = self.layers[i](h, cos, sin, document_ids)
            if not part.last:
                return h
            h = self.norm(h)
        else:
            h = self.hidden_states(input_ids, position_ids, document_ids)
        if labels is None:
            return h @ self.head_weight().t() if self.output is None else self.output(h)
        if self.output is None:
            return kernels.head_loss(self.loss, h, self.tok_embeddings.weight, labels)
        return self.output(h, labels)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random init: normal(0, std) for matrices and embeddings, ones for norms (zeros for
        zero-centred ones), Gated DeltaNet's decay as transformers draws it. Seed first."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, ZeroCentredRMSNorm):
                nn.init.zeros_(module.weight)
            elif isinstance(module, (RMSNorm, GatedRMSNorm)):
                nn.init.ones_(module.weight)
            elif isinstance(module, (GroupedExperts, GatedDeltaNet)):  # a GatedDeltaNet's own tensors only
                module.init_weights(std)
            elif isinstance(module, TopKRouter):  # its gate is an nn.Linear, initialised above
                module.expert_bias.zero_()
        self.init_buffers()

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers; call after to_empty and after loading weights."""
        self.rotary.reset_parameters()
        for module in self.modules():
            if isinstance(module, TopKRouter):
                module.reset_buffers()

"""A preallocated decoding cache for the native model.

Full-attention layers: `Attention.forward` / `GatedAttention.forward` take one layer's view
(`KVCache.layer(i)`): it appends the keys and values of the new positions and attends over
everything cached so far through the same `attention` op as training (the op's queries are the
last positions of its keys). Prefill and every decode step therefore compute exactly what the
full forward computes for those positions.

Gated DeltaNet layers (Qwen3.5, Qwen3-Next) keep no keys: their whole past is two small tensors,
the convolution's window (the last K - 1 inputs of the causal conv) and the recurrent state.
`GatedDeltaNet.forward` takes that layer's `DeltaLayerCache`, continues the conv from the window
and the `gated_delta` op from the state, and writes both back.
"""

from __future__ import annotations

import torch

from titanite.models.qwen3.args import Qwen3Args


class KVCache:
    """Keys and values of every full-attention layer: k, v are [La, B, Hk, max_len, D] (La the
    number of attention layers), plus a DeltaLayerCache per Gated DeltaNet layer.

    `length` positions are filled. A forward over n new tokens writes positions
    [length, length + n) in every attention layer (and moves every Gated DeltaNet layer's state
    past them); `advance(n)` then commits them.
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device, linear_layers: frozenset[int] = frozenset()) -> None:
        self.slots = {i: n for n, i in enumerate(i for i in range(num_layers) if i not in linear_layers)}
        shape = (len(self.slots), batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.delta: dict[int, DeltaLayerCache] = {}
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(cls, a: Qwen3Args, batch: int, max_len: int, dtype: torch.dtype,
                  device: torch.device) -> KVCache:
        """An empty cache for architecture `a`: Gated DeltaNet layers get their conv window
        (in `dtype`) and an unset recurrent state, the others keys and values."""
        linear = frozenset(i for i in range(a.num_layers) if a.layer_is_linear(i))
        cache = cls(a.num_layers, batch, a.num_kv_heads, a.head_dim, max_len, dtype, device, linear)
        if linear:
            keys = a.linear_num_key_heads * a.linear_key_head_dim
            channels = 2 * keys + a.linear_num_value_heads * a.linear_value_head_dim
            for i in linear:
                cache.delta[i] = DeltaLayerCache(batch, channels, a.linear_conv_kernel_dim, dtype, device)
        return cache

    def layer(self, i: int) -> LayerCache | DeltaLayerCache:
        return self.delta[i] if i in self.delta else LayerCache(self, self.slots[i])

    def advance(self, n: int) -> None:
        self.length += n


class LayerCache:
    """One attention layer's slice of a KVCache."""

    def __init__(self, cache: KVCache, slot: int) -> None:
        self.cache, self.index = cache, slot

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, Hk, n, D] for the new positions -> every cached key and value, [B, Hk, length + n, D]."""
        c = self.cache
        start, end = c.length, c.length + k.shape[2]
        if end > c.max_len:
            raise AssertionError(f"KV cache holds {c.max_len} positions, asked for {end}")
        c.k[self.index, :, :, start:end] = k
        c.v[self.index, :, :, start:end] = v
        return c.k[self.index, :, :, :end], c.v[self.index, :, :, :end]


class DeltaLayerCache:
    """One Gated DeltaNet layer's decoding state.

    window: [B, K - 1, C] in the model's dtype, the conv's inputs (q|k|v projections, before the
        conv) at the last K - 1 positions, zeros before the first token: the zero padding the
        causal conv sees at a row's start, so prefill from an empty window is the full forward.
    state: [B, Hv, Dk, Dv] fp32, the recurrence's state after the last cached token; None before
        the prefill (the `gated_delta` op then starts from zeros, as training does).
    """

    def __init__(self, batch: int, channels: int, kernel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.window = torch.zeros(batch, kernel - 1, channels, dtype=dtype, device=device)
        self.state: torch.Tensor | None = None

    def extend(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, n, C] the new positions' conv inputs -> [B, K - 1 + n, C], the window followed
        by them (what the conv reads); the window moves to the last K - 1 of those."""
        seen = torch.cat((self.window, x), dim=1)
        self.window = seen[:, seen.shape[1] - self.window.shape[1]:].clone()  # clone: drop the rest of `seen`
        return seen

"""A preallocated KV cache for decoding with the native model.

`Attention.forward` takes one layer's view (`KVCache.layer(i)`): it appends the keys and values
of the new positions and attends over everything cached so far through the same `attention`
op as training (the op's queries are the last positions of its keys). Prefill and every decode
step therefore compute exactly what the full forward computes for those positions.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer: k, v are [L, B, Hk, max_len, D].

    `length` positions are filled. A forward over n new tokens writes positions
    [length, length + n) in every layer; `advance(n)` then commits them.
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self, i)

    def advance(self, n: int) -> None:
        self.length += n


class LayerCache:
    """One layer's slice of a KVCache."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache, self.index = cache, layer

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, Hk, n, D] for the new positions -> every cached key and value, [B, Hk, length + n, D]."""
        c = self.cache
        start, end = c.length, c.length + k.shape[2]
        if end > c.max_len:
            raise AssertionError(f"KV cache holds {c.max_len} positions, asked for {end}")
        c.k[self.index, :, :, start:end] = k
        c.v[self.index, :, :, start:end] = v
        return c.k[self.index, :, :, :end], c.v[self.index, :, :, :end]

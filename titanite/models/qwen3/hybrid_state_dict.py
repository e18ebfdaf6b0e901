"""Native <-> Hugging Face names for Qwen3.5 and Qwen3-Next, and their seeded random init.

The text model's names only (`model.layers.*`, `model.embed_tokens.*`, `lm_head.*`): a
multimodal folder's `model.language_model.*` prefix, its vision tower and MTP weights are the
checkpoint layout's business (titanite/formats/layout.py), on both backends.

Gated DeltaNet layers (`layers.{i}.attention.*` natively, `linear_attn.*` in HF):

- Qwen3.5 stores the blocks natively fused: w_qkvz rows q | k | v | z are `in_proj_qkv` (q | k | v)
  then `in_proj_z`; w_ba rows b | a are `in_proj_b` then `in_proj_a` (views, no copy).
- Qwen3-Next fuses them per key head: `in_proj_qkvz` [Hk, (q_h, k_h, v_h, z_h)] with the
  Hv / Hk value heads of key head h inside v_h and z_h, and `in_proj_ba` [Hk, (b_h, a_h)].
  `_interleave` / `_deinterleave` convert exactly (a permutation of rows).
- `conv1d.weight` [C, 1, K] is natively conv_weight [C, K].

Full-attention layers keep Qwen3's names (q_proj holds the queries and the output gate). The
shared expert: `mlp.shared_expert.{gate,up,down}_proj` and `mlp.shared_expert_gate`.
"""

from __future__ import annotations

import torch

from titanite.formats.sharded import RandomSource, box_index, name_seed
from titanite.models.qwen3.args import Qwen3Args
from titanite.models.qwen3.state_dict import _LAYER, Qwen3StateDictAdapter

# native suffix of a Gated DeltaNet block -> HF suffix, one tensor each
_LINEAR = {
    "attention.A_log": "linear_attn.A_log",
    "attention.dt_bias": "linear_attn.dt_bias",
    "attention.norm.weight": "linear_attn.norm.weight",
    "attention.wo.weight": "linear_attn.out_proj.weight",
}
_FUSED = ("attention.w_qkvz.weight", "attention.w_ba.weight", "attention.conv_weight")
_SHARED = {
    "feed_forward.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}


class HybridStateDictAdapter(Qwen3StateDictAdapter):
    """Qwen3StateDictAdapter plus the Gated DeltaNet and shared-expert tensors."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args)
        self.next = args.model_type == "qwen3_next"
        self.keys = args.linear_num_key_heads * args.linear_key_head_dim  # q (and k) rows
        self.values = args.linear_num_value_heads * args.linear_value_head_dim  # v (and z) rows

    def _linear_suffix(self, name: str) -> tuple[str, str] | None:
        """(layer, suffix) of a native tensor inside a Gated DeltaNet block, else None."""
        m = _LAYER.fullmatch(name)
        if m is None or not self.args.layer_is_linear(int(m.group(1))) or not m.group(2).startswith("attention."):
            return None
        return m.group(1), m.group(2)

    def to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        m = _LAYER.fullmatch(name)
        if m is not None and m.group(2) in _SHARED:
            return [(f"model.layers.{m.group(1)}.{_SHARED[m.group(2)]}", tensor)]
        found = self._linear_suffix(name)
        if found is None:
            return super().to_hf(name, tensor)
        layer, suffix = found
        at = f"model.layers.{layer}.linear_attn"
        if suffix in _LINEAR:
            return [(f"model.layers.{layer}.{_LINEAR[suffix]}", tensor)]
        if suffix == "attention.conv_weight":
            return [(f"{at}.conv1d.weight", tensor.unsqueeze(1))]  # [C, K] -> [C, 1, K]
        if suffix == "attention.w_qkvz.weight":
            if self.next:
                return [(f"{at}.in_proj_qkvz.weight", self._interleave(tensor, self._qkvz_blocks()))]
            qkv = 2 * self.keys + self.values
            return [(f"{at}.in_proj_qkv.weight", tensor[:qkv]), (f"{at}.in_proj_z.weight", tensor[qkv:])]
        if suffix == "attention.w_ba.weight":
            if self.next:
                return [(f"{at}.in_proj_ba.weight", self._interleave(tensor, self._ba_blocks()))]
            heads = self.args.linear_num_value_heads
            return [(f"{at}.in_proj_b.weight", tensor[:heads]), (f"{at}.in_proj_a.weight", tensor[heads:])]
        raise KeyError(f"no Hugging Face name for native parameter '{name}'")

    def from_hf(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        found = self._linear_suffix(name)
        if found is None or found[1] not in _FUSED:
            return super().from_hf(name, tensors)
        suffix = found[1]
        if suffix == "attention.conv_weight":
            (t,) = tensors
            return t.squeeze(1)
        if self.next:
            (t,) = tensors
            return self._deinterleave(t, self._qkvz_blocks() if suffix == "attention.w_qkvz.weight" else self._ba_blocks())
        return torch.cat(tensors)

    # -- Qwen3-Next's per-key-head interleaving ------------------------------------------------

    def _qkvz_blocks(self) -> list[int]:
        """Rows per key head of q, k, v, z in in_proj_qkvz."""
        a = self.args
        per_value = a.linear_num_value_heads // a.linear_num_key_heads * a.linear_value_head_dim
        return [a.linear_key_head_dim, a.linear_key_head_dim, per_value, per_value]

    def _ba_blocks(self) -> list[int]:
        """Rows per key head of b, a in in_proj_ba."""
        r = self.args.linear_num_value_heads // self.args.linear_num_key_heads
        return [r, r]

    def _interleave(self, native: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """[sum_b Hk * b, H] with whole blocks one after the other -> [Hk * sum(blocks), H] grouped
        by key head: head h's rows of each block, block after block."""
        Hk, cols = self.args.linear_num_key_heads, native.shape[1]
        parts = native.split([Hk * b for b in blocks])
        return torch.cat([p.reshape(Hk, b, cols) for p, b in zip(parts, blocks, strict=True)], dim=1).reshape(-1, cols)

    def _deinterleave(self, fused: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """Inverse of _interleave."""
        Hk, cols = self.args.linear_num_key_heads, fused.shape[1]
        parts = fused.reshape(Hk, sum(blocks), cols).split(blocks, dim=1)
        return torch.cat([p.reshape(-1, cols) for p in parts])


class HybridRandomSource(RandomSource):
    """The seeded random init (sharded.RandomSource) with the hybrid models' rules, by HF key:
    zero-centred norms at 0, the gated norm of Gated DeltaNet at 1, A = exp(A_log) uniform in
    [0.01, 16] and dt_bias 1, as transformers initialises them."""

    def read(self, key: str, shape: tuple[int, ...], starts: tuple[int, ...], sizes: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
        if key.endswith(("linear_attn.norm.weight", "linear_attn.dt_bias")):
            return torch.ones(sizes, dtype=dtype)
        if key.endswith("norm.weight"):  # every other norm computes x * (1 + w)
            return torch.zeros(sizes, dtype=dtype)
        if key.endswith("linear_attn.A_log"):
            g = torch.Generator().manual_seed(name_seed("titanite-init", self.seed, key))
            return torch.empty(shape).uniform_(0.01, 16, generator=g).log_()[box_index(starts, sizes)].to(dtype)
        return super().read(key, shape, starts, sizes, dtype)

"""Native <-> Hugging Face parameter names for Qwen3.

`to_hf` splits one native tensor into its HF tensors (works on meta tensors, so the loader can
learn the expected HF names and shapes without touching data); `from_hf` is its inverse.
"""

from __future__ import annotations

import re

import torch

from titanite.models.qwen3.args import Qwen3Args

# native suffix inside a block -> HF suffix inside `model.layers.{i}.`
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


class Qwen3StateDictAdapter:
    def __init__(self, args: Qwen3Args) -> None:
        self.args = args

    def to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One native tensor -> its HF (key, tensor) pairs, in a fixed order."""
        if name in _TOP:
            return [(_TOP[name], tensor)]
        m = _LAYER.fullmatch(name)
        if m and m.group(2) in _BLOCK:
            return [(f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}", tensor)]
        raise KeyError(f"no Hugging Face name for native parameter '{name}'")

    def from_hf(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `to_hf`: the HF tensors, in `to_hf`'s order, -> the native tensor."""
        (t,) = tensors
        return t

    def ignorable_hf_keys(self) -> set[str]:
        """HF keys a checkpoint may carry that the native model has no parameter for."""
        return {"lm_head.weight"} if self.args.tie_word_embeddings else set()

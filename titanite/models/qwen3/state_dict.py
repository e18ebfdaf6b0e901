"""Native <-> Hugging Face parameter names for Qwen3 and Qwen3-MoE.

`to_hf` splits one native tensor into its HF tensors (works on meta tensors, so the loader can
learn the expected HF names and shapes without touching data); `from_hf` is its inverse.

MoE experts: published checkpoints (and transformers' save_pretrained) store each expert
separately, `mlp.experts.{e}.{gate,up,down}_proj.weight`; natively they are stacked,
w_gate_up [E, 2I, H] (gate rows, then up rows) and w_down [E, H, I]. The router's balancing
bias (`expert_bias`) has no place in the Hugging Face layout: it is not exported, and a
Hugging Face load starts it at zero.
"""

from __future__ import annotations

import re

import torch

from titanite.models.experts_layout import DOWN, GATE_UP, fuse_experts, split_experts
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
    "feed_forward.router.gate.weight": "mlp.gate.weight",
}
_EXPERTS = {"feed_forward.experts.w_gate_up": GATE_UP, "feed_forward.experts.w_down": DOWN}
_EXPERT_BIAS = "feed_forward.router.expert_bias"
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
        if m is None:
            raise KeyError(f"no Hugging Face name for native parameter '{name}'")
        layer, suffix = m.groups()
        if suffix in _BLOCK:
            return [(f"model.layers.{layer}.{_BLOCK[suffix]}", tensor)]
        experts = f"model.layers.{layer}.mlp.experts"
        if suffix in _EXPERTS:
            return split_experts(experts, _EXPERTS[suffix], tensor)
        if suffix == _EXPERT_BIAS:
            return []
        raise KeyError(f"no Hugging Face name for native parameter '{name}'")

    def from_hf(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `to_hf`: the HF tensors, in `to_hf`'s order, -> the native tensor."""
        suffix = name.split(".", 2)[-1]
        if suffix in _EXPERTS:
            return fuse_experts(_EXPERTS[suffix], tensors)
        if suffix == _EXPERT_BIAS:  # not in the HF layout: a zero that broadcasts over [E]
            assert not tensors
            return torch.zeros(())
        (t,) = tensors
        return t

    def skips(self, name: str) -> bool:
        """Keys of this model's state dict that are not weights of the Hugging Face layout."""
        return False

    def ignorable_hf_keys(self) -> set[str]:
        """HF keys a checkpoint may carry that the native model has no parameter for."""
        return {"lm_head.weight"} if self.args.tie_word_embeddings else set()

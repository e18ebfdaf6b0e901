"""HFCausalLM state-dict keys <-> the Hub's on-disk keys.

In memory transformers 5.x fuses each Qwen3-MoE layer's experts into
`mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first, then up) and
`mlp.experts.down_proj [E, H, I]`; on disk (published checkpoints, and what transformers
itself saves) every expert has its own `mlp.experts.{e}.{gate,up,down}_proj.weight`.
Everything else is `hf.` + the on-disk key.
"""

from __future__ import annotations

import re

import torch

from titanite.models.experts_layout import DOWN, GATE_UP, fuse_experts, split_experts

PREFIX = "hf."
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_FUSED = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")
_KINDS = {"gate_up_proj": GATE_UP, "down_proj": DOWN}


class HFStateDictAdapter:
    def __init__(self, tie_word_embeddings: bool) -> None:
        self.tied = tie_word_embeddings

    def to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One HFCausalLM tensor -> its on-disk (key, tensor) pairs, in a fixed order. Works on
        meta tensors. A tied head maps to the embedding it is."""
        assert name.startswith(PREFIX), name
        key = name[len(PREFIX):]
        if self.tied and key == HEAD:
            return [(EMBED, tensor)]
        m = _FUSED.fullmatch(key)
        if m is None:
            return [(key, tensor)]
        experts, kind = m.groups()
        return split_experts(experts, _KINDS[kind], tensor)

    def from_hf(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `to_hf`: the on-disk tensors, in `to_hf`'s order -> the in-memory tensor."""
        m = _FUSED.fullmatch(name[len(PREFIX):])
        if m is None:
            (t,) = tensors
            return t
        return fuse_experts(_KINDS[m.group(2)], tensors)

    def skips(self, name: str) -> bool:
        """Keys of this model's state dict that are not weights of the Hugging Face layout."""
        return False

    def ignorable_hf_keys(self) -> set[str]:
        """A tied checkpoint may still carry a copy of the head; the embedding is the weight."""
        return {HEAD} if self.tied else set()

"""ModelSpec for the native Qwen3 (dense and MoE)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from titanite.checkpoint.hf_weights import load_with_adapter
from titanite.checkpoint.safetensors_io import read_hf_config
from titanite.config import ModelConfig
from titanite.models.qwen3.args import Qwen3Args, from_hf_config, to_hf_config
from titanite.models.qwen3.flavors import get_flavor
from titanite.models.qwen3.model import Qwen3
from titanite.models.qwen3.state_dict import Qwen3StateDictAdapter
from titanite.models.spec import ModelSpec, register_spec


def resolve_args(cfg: ModelConfig) -> Qwen3Args:
    """config.json decides the architecture when hf_path is set; otherwise the flavor does."""
    if cfg.hf_path:
        return from_hf_config(read_hf_config(cfg.hf_path), where=f"{cfg.hf_path}/config.json")
    return get_flavor(cfg.flavor)


class Qwen3Spec(ModelSpec):
    name = "qwen3"

    def build(self, cfg: ModelConfig) -> nn.Module:
        args = resolve_args(cfg)
        with torch.device("meta"):
            model = Qwen3(args)
        model.source_hf_config = read_hf_config(cfg.hf_path) if cfg.hf_path else None
        return model

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        # Start from the checkpoint's own config.json so fields titanite does not model survive.
        base = dict(model.source_hf_config or {})
        base.update(to_hf_config(model.args))
        return base

    def init_weights(self, model: nn.Module, std: float) -> None:
        model.init_weights(std)

    def init_buffers(self, model: nn.Module) -> None:
        model.init_buffers()

    def load_hf(self, model: nn.Module, folder: str) -> None:
        load_with_adapter(model, Qwen3StateDictAdapter(model.args), folder)
        model.init_buffers()

    def hf_state_dict(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        adapter = Qwen3StateDictAdapter(model.args)
        for name, tensor in model.state_dict().items():
            yield from adapter.to_hf(name, tensor)

    def flops_per_token(self, model: nn.Module, seq_len: int) -> float:
        return flops_per_token(model.args, seq_len)


def flops_per_token(a: Qwen3Args, seq_len: int) -> float:
    """6 x (parameters a token passes through, head included) + attention scores and values.

    Attention: per layer and token, QK^T and AV are 2 * 2 * S * Hq * D forward FLOPs for the
    full (non-causal) square; x3 for backward. The causal half is not discounted, as is usual.
    """
    attn_proj = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
    dense_mlp = 3 * a.hidden_size * a.intermediate_size
    active_mlp = 3 * a.hidden_size * a.moe_intermediate_size * a.num_experts_per_tok + a.hidden_size * a.num_experts
    matmul_params = a.hidden_size * a.vocab_size  # output head
    for i in range(a.num_layers):
        matmul_params += attn_proj + (active_mlp if a.layer_is_moe(i) else dense_mlp)
    attention = 12 * a.num_layers * a.num_heads * a.head_dim * seq_len
    return 6 * matmul_params + attention


register_spec(Qwen3Spec())

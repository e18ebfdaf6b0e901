"""The transformers config for the hf backend, from a checkpoint's config.json or a named flavor.

config.json is the authority. transformers reads it through its config classes, which fill gaps
with library defaults (e.g. Qwen3-MoE's `router_aux_loss_coef = 0.001`) and have, in some
releases, replaced stated values (RoPE theta forced to 1e4). So every value that changes the
math is read a second time by titanite's own parser (`from_hf_config`, shared with the native
backend) and the transformers config is pinned to it. Both backends therefore run the same math
from the same file.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from titanite.core.config import ModelConfig
from titanite.core.errors import UserError
from titanite.formats.safetensors_io import read_hf_config
from titanite.models.qwen3.args import (
    Qwen3Args,
    from_hf_config,
    rope_fields,
    rope_parameters,
    to_hf_config,
    with_rope_scaling,
)
from titanite.models.qwen3.flavors import get_flavor

log = logging.getLogger("titanite")

# Qwen3Args field -> transformers config attribute (rope_theta and rope_scaling live in rope_parameters).
_ATTRIBUTE = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings", "tie_word_embeddings": "tie_word_embeddings",
    "num_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size", "norm_topk_prob": "norm_topk_prob",
    "decoder_sparse_step": "decoder_sparse_step", "mlp_only_layers": "mlp_only_layers",
    "router_aux_loss_coef": "router_aux_loss_coef", "output_router_logits": "output_router_logits",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
    # Qwen3.5 / Qwen3-Next (partial_rotary_factor lives in rope_parameters too)
    "layer_types": "layer_types", "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads", "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim", "linear_conv_kernel_dim": "linear_conv_kernel_dim",
    "shared_expert_intermediate_size": "shared_expert_intermediate_size",
}
# Fields the model type fixes (the config class, not an attribute, states them): never pinned.
_OF_MODEL_TYPE = ("model_type", "attn_output_gate", "zero_centred_norms")
_ROPE = ("rope_theta", "rope_scaling", "partial_rotary_factor")


def resolve(cfg: ModelConfig) -> tuple[PretrainedConfig, Qwen3Args, dict[str, Any] | None]:
    """(transformers config pinned to the checkpoint, the same architecture as Qwen3Args, the
    checkpoint's config.json dict or None for a flavor), with `model.rope_scaling` applied."""
    if cfg.hf_path:
        where = f"{cfg.hf_path}/config.json"
        source = read_hf_config(cfg.hf_path)
        args = from_hf_config(source, where=where)
        try:
            # Remote code runs only when the user asked for it: off, a known model_type uses the
            # library's own class and any `auto_map` in config.json is ignored.
            config = AutoConfig.from_pretrained(cfg.hf_path, trust_remote_code=cfg.trust_remote_code)
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise UserError(f"{where}: transformers cannot read it: {e}") from e
    else:
        where = f"flavor '{cfg.flavor}'"
        args, source = get_flavor(cfg.flavor), None
        fields = to_hf_config(args)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if cfg.rope_scaling:  # model.rope_scaling replaces the file's RoPE settings, in the export too
        args = with_rope_scaling(args, cfg.rope_scaling)
        config.rope_parameters = rope_parameters(args)
        config.max_position_embeddings = args.max_position_embeddings
        source = None if source is None else {**source, **rope_fields(args)}
    pin(config, args, where)
    return config, args, source


def args_of(config: PretrainedConfig, where: str) -> Qwen3Args:
    """How transformers' config object reads, as titanite's architecture arguments."""
    return from_hf_config(config.to_dict(), where=f"transformers' reading of {where}")


def pin(config: PretrainedConfig, want: Qwen3Args, where: str) -> None:
    """Set every math-relevant value of `config` that differs from `want` back to `want`. A
    multimodal config (Qwen3.5) is pinned in its text config, but for the tied head, which
    transformers reads at the top level."""
    got = args_of(config, where)
    text = config.get_text_config()
    for f in dataclasses.fields(Qwen3Args):
        have, value = getattr(got, f.name), getattr(want, f.name)
        if have == value:
            continue
        assert f.name not in _OF_MODEL_TYPE, f"{where}: {type(config).__name__} has {f.name}={have!r}, not {value!r}"
        # `value` is what the file states, or titanite's documented default where it is silent.
        log.warning("%s: transformers' config has %s=%r but %s gives %r; using %r",
                    type(config).__name__, f.name, have, where, value, value)
        if f.name in _ROPE:  # MRoPE's sections (vision positions) are not titanite's to change
            mrope = {k: v for k, v in (text.rope_parameters or {}).items() if k.startswith("mrope")}
            text.rope_parameters = {**mrope, **rope_parameters(want)}
        else:
            target = config if f.name == "tie_word_embeddings" else text
            setattr(target, _ATTRIBUTE[f.name], list(value) if isinstance(value, tuple) else value)
    assert args_of(config, where) == want, f"could not pin {type(config).__name__} to {where}"

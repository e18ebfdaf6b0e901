"""Qwen3.5 and Qwen3-Next config.json <-> Qwen3Args (the hybrid fields; args.py holds the rest).

Five model types: `qwen3_5_text` (dense), `qwen3_5_moe_text` and `qwen3_next` (MoE with a shared
expert), and the multimodal `qwen3_5` / `qwen3_5_moe`, whose `text_config` holds the text model.
What differs from Qwen3, all read from the file:

- `layer_types`: "linear_attention" (Gated DeltaNet) or "full_attention" per layer; absent, every
  `full_attention_interval`-th layer (default 4) is full attention, as transformers derives it;
- the Gated DeltaNet widths `linear_*`;
- partial RoPE: `partial_rotary_factor` (rope_parameters, else top level; transformers' default
  for these types is 0.25). MRoPE's `mrope_section` only matters for vision positions: text
  positions are the same on all three axes, so text RoPE is plain 1-D (kept for the export);
- always, in all three families: the gated full attention and the zero-centred norms;
- MoE: a shared expert (`shared_expert_intermediate_size`); Qwen3.5-MoE has every layer sparse
  and always renormalises the top-k weights (its config has no norm_topk_prob).
"""

from __future__ import annotations

from typing import Any

from titanite.core.errors import UserError
from titanite.models.qwen3.config_fields import REQUIRED, base_kwargs, moe_kwargs, read_float, read_int, rope_fields

# Qwen3.5 and Qwen3-Next; the multimodal types hold the text model in `text_config`.
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")

LAYER_TYPES = ("linear_attention", "full_attention")
# multimodal model_type -> its text model's model_type
TEXT_TYPE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
ARCHITECTURE = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
_MOE_TYPES = ("qwen3_5_moe_text", "qwen3_next")
# rope_parameters keys of the multimodal position scheme, carried through an export untouched
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


# `args` below is a Qwen3Args (args.py builds it from these modules' fields, so they cannot import it).


def is_multimodal(args: Any) -> bool:
    return args.model_type in TEXT_TYPE


def text_model_type(args: Any) -> str:
    return TEXT_TYPE.get(args.model_type, args.model_type)


def hybrid_from_hf_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The Qwen3Args fields of a Qwen3.5 / Qwen3-Next config.json dict (see the module docstring)."""
    top = cfg["model_type"]
    text, text_where = cfg, where
    if top in TEXT_TYPE:
        text, text_where = cfg.get("text_config"), f"{where} (text_config)"
        if not isinstance(text, dict):
            raise UserError(f"{where}: model_type {top!r} needs a 'text_config' object (the text model), "
                            f"got {text!r}")
        if text.get("model_type", TEXT_TYPE[top]) != TEXT_TYPE[top]:
            raise UserError(f"{text_where}: 'model_type' is {text['model_type']!r}, expected {TEXT_TYPE[top]!r}")
        # transformers ties the multimodal model's head by the top-level flag
        text = {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    kind = TEXT_TYPE.get(top, top)
    kw = base_kwargs(text, text_where, intermediate_default=0 if kind == "qwen3_5_moe_text" else REQUIRED)
    kw.update(_linear_attention(text, kw["num_layers"], text_where))
    kw.update(model_type=top, attn_output_gate=True, zero_centred_norms=True,
              partial_rotary_factor=_partial_rotary_factor(text, text_where))
    if kind in _MOE_TYPES:
        kw.update(_hybrid_moe(text, kind, kw["num_layers"], text_where))
    return kw


def _linear_attention(cfg: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    types = cfg.get("layer_types")
    if types is None:
        interval = read_int(cfg, "full_attention_interval", where, default=4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise UserError(f"{where}: 'layer_types' must list one type per layer ({num_layers}, "
                        f"num_hidden_layers), got {types!r}")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise UserError(f"{where}: 'layer_types' holds {t!r} (layer {i}), which titanite does not know; "
                            f"the types are {', '.join(map(repr, LAYER_TYPES))}")
    kw = {k: read_int(cfg, k, where, default=d) for k, d in (
        ("linear_num_key_heads", 16), ("linear_num_value_heads", 32), ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128), ("linear_conv_kernel_dim", 4))}  # transformers' defaults
    if kw["linear_num_value_heads"] % kw["linear_num_key_heads"]:
        raise UserError(f"{where}: 'linear_num_value_heads' ({kw['linear_num_value_heads']}) must be a multiple "
                        f"of 'linear_num_key_heads' ({kw['linear_num_key_heads']})")
    return {**kw, "layer_types": tuple(types)}


def _partial_rotary_factor(cfg: dict[str, Any], where: str) -> float:
    params = cfg.get("rope_parameters") or {}
    key = "rope_parameters.partial_rotary_factor" if "partial_rotary_factor" in params else "partial_rotary_factor"
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    factor = read_float({key: factor}, key, where)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if factor > 1 or int(head_dim * factor) % 2:
        raise UserError(f"{where}: '{key}' ({factor}) must be at most 1 and turn an even number of dims "
                        f"of head_dim ({head_dim})")
    return factor


def _hybrid_moe(cfg: dict[str, Any], kind: str, num_layers: int, where: str) -> dict[str, Any]:
    if kind == "qwen3_next" and cfg.get("num_experts") == 0:  # a dense Qwen3-Next
        return {}
    if kind == "qwen3_5_moe_text":  # every layer sparse, top-k always renormalised
        cfg = {**cfg, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    else:  # Qwen3-Next's config class renormalises unless told not to (Qwen3-MoE's does not)
        cfg = {**cfg, "norm_topk_prob": cfg.get("norm_topk_prob", True)}
    kw = moe_kwargs(cfg, num_layers, where)
    kw["shared_expert_intermediate_size"] = read_int(cfg, "shared_expert_intermediate_size", where)
    return kw


def hybrid_to_hf_config(args: Any) -> dict[str, Any]:
    """A config.json dict transformers 5.x builds as the same architecture; multimodal types get
    the text model in `text_config` (the vision tower's config comes from the source file)."""
    kind = text_model_type(args)
    text: dict[str, Any] = {
        "model_type": kind,
        "vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads, "head_dim": args.head_dim, "hidden_act": "silu",
        "rms_norm_eps": args.rms_norm_eps, **rope_fields(args),
        "tie_word_embeddings": args.tie_word_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "layer_types": list(args.layer_types),
        "linear_num_key_heads": args.linear_num_key_heads, "linear_num_value_heads": args.linear_num_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim, "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
        "bos_token_id": args.bos_token_id, "eos_token_id": args.eos_token_id,
    }
    if kind != "qwen3_5_moe_text":  # its config class has no dense MLP width
        text["intermediate_size"] = args.intermediate_size
    if args.is_moe:
        text.update(num_experts=args.num_experts, num_experts_per_tok=args.num_experts_per_tok,
                    moe_intermediate_size=args.moe_intermediate_size,
                    shared_expert_intermediate_size=args.shared_expert_intermediate_size,
                    router_aux_loss_coef=args.router_aux_loss_coef, output_router_logits=args.output_router_logits)
    if kind == "qwen3_next":
        text.update(norm_topk_prob=args.norm_topk_prob, decoder_sparse_step=args.decoder_sparse_step,
                    mlp_only_layers=list(args.mlp_only_layers))
    if not is_multimodal(args):
        return {"architectures": [ARCHITECTURE[kind]], **text, "dtype": "float32"}
    return {"architectures": [ARCHITECTURE[args.model_type]], "model_type": args.model_type, "text_config": text,
            "tie_word_embeddings": args.tie_word_embeddings, "dtype": "float32"}


def merge_into_source(source: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """The export's config.json: the checkpoint's own (fields titanite does not model survive:
    the vision tower's config, token ids of images, MRoPE sections) with ours on top."""
    out = {**source, **ours}
    src_text, our_text = source.get("text_config"), ours.get("text_config")
    if isinstance(src_text, dict) and our_text is not None:
        out["text_config"] = merge_into_source(src_text, our_text)
    src_rope = source.get("rope_parameters")
    if isinstance(src_rope, dict) and "rope_parameters" in ours:
        kept = {k: src_rope[k] for k in _MROPE_KEYS if k in src_rope}
        out["rope_parameters"] = {**kept, **ours["rope_parameters"]}
    return out

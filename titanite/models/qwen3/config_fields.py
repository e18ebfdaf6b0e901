"""Reading config.json values for Qwen3Args, and writing its positions back: the checks every
family shares (args.py for Qwen3 and Qwen3-MoE, hybrid_args.py for Qwen3.5 and Qwen3-Next).

Every value that changes the math is read from the file; titanite never substitutes a library
default for a value the checkpoint states (rope theta above all)."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from titanite.core.config_checks import rope_scaling_fields, rope_type_of
from titanite.core.errors import UserError

log = logging.getLogger("titanite")


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE in transformers' `rope_parameters` terms. Optional yarn fields left None take
    transformers' defaults where the frequencies are computed (model.py RotaryEmbedding) and stay
    out of the exported config.json, as transformers leaves them out."""

    rope_type: str  # one of config_checks.ROPE_FIELDS
    factor: float  # > 1
    original_max_position_embeddings: int | None = None  # yarn (always set): the pretraining length
    attention_factor: float | None = None  # yarn: scales cos/sin; default from factor (and mscale)
    beta_fast: float | None = None  # yarn: default 32
    beta_slow: float | None = None  # yarn: default 1
    mscale: float | None = None  # yarn: with mscale_all_dim, sets the default attention_factor
    mscale_all_dim: float | None = None
    truncate: bool | None = None  # yarn: default true

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def read_rope(cfg: dict[str, Any], max_pos: int, where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) as transformers reads them: the legacy `rope_scaling` when set, else
    `rope_parameters`; theta from that dict, else the top-level `rope_theta` (never a default)."""
    params, scaling = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    if not isinstance(params or {}, dict) or not isinstance(scaling or {}, dict):
        raise UserError(f"{where}: rope_parameters / rope_scaling must be JSON objects")
    name, chosen = ("rope_scaling", dict(scaling)) if scaling else ("rope_parameters", dict(params or {}))
    if scaling and params and rope_type_of(params) != rope_type_of(scaling):
        log.warning("%s: rope_scaling (%s) and rope_parameters (%s) differ; transformers reads rope_scaling, "
                    "and so does titanite", where, rope_type_of(scaling), rope_type_of(params))
    key = f"{name}.rope_theta" if "rope_theta" in chosen else "rope_theta"
    theta = chosen.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise UserError(f"{where}: no rope_theta (neither {name}.rope_theta nor rope_theta)")
    theta = read_float({key: theta}, key, where)
    if rope_type_of(chosen) == "yarn" and "original_max_position_embeddings" in cfg:
        # transformers gives a top-level original_max_position_embeddings priority (Phi-3's layout)
        chosen["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return theta, parse_rope_scaling(chosen, f"{where}: '{name}.{{}}'", max_pos, strict=False)


def parse_rope_scaling(d: dict[str, Any], at: str, max_pos: int, strict: bool,
                       original: int | None = None) -> RopeScaling | None:
    """The scaling a rope_parameters-style dict states (None for plain RoPE), checked by
    config_checks.rope_scaling_fields (`at`, `strict`: see there). yarn's pretraining length
    defaults to `original`, else max_pos, as transformers defaults it to max_position_embeddings."""
    kw = rope_scaling_fields(d, at, strict)
    if kw is None:
        return None
    if kw["rope_type"] == "yarn":
        kw.setdefault("original_max_position_embeddings", original or max_pos)
    return RopeScaling(**kw)


REQUIRED = object()


def read_int(cfg: dict[str, Any], key: str, where: str, minimum: int = 1, default: Any = REQUIRED) -> int:
    """cfg[key] as an int >= minimum. An absent key takes `default` (an error when there is none);
    a key that is present must hold a valid value: 0 or null is never quietly replaced."""
    if key not in cfg:
        if default is REQUIRED:
            raise UserError(f"{where}: missing key '{key}'")
        return default
    v = cfg[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise UserError(f"{where}: '{key}' must be an integer, got {v!r}")
    if v < minimum:
        raise UserError(f"{where}: '{key}' must be >= {minimum}, got {v}")
    return v


def read_float(cfg: dict[str, Any], key: str, where: str, allow_zero: bool = False) -> float:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UserError(f"{where}: '{key}' must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise UserError(f"{where}: '{key}' must be a finite number {'>= 0' if allow_zero else '> 0'}, got {v}")
    return v


def read_token_id(cfg: dict[str, Any], key: str, vocab: int, where: str) -> int | list[int] | None:
    v = cfg.get(key)
    ids = v if isinstance(v, list) else [] if v is None else [v]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
            raise UserError(f"{where}: '{key}' holds {i!r}, which is not a token id below vocab_size ({vocab})")
    return v


def base_kwargs(cfg: dict[str, Any], where: str, intermediate_default: Any = REQUIRED) -> dict[str, Any]:
    """The Qwen3Args fields every family states the same way: widths, heads, norms, RoPE,
    embeddings and token ids (see from_hf_config)."""
    if cfg.get("attention_bias"):
        raise UserError(f"{where}: attention_bias=true is not part of Qwen3 and is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (Qwen3 uses silu)")
    hidden = read_int(cfg, "hidden_size", where)
    heads = read_int(cfg, "num_attention_heads", where)
    kv_heads = read_int(cfg, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise UserError(f"{where}: 'num_attention_heads' ({heads}) must be a multiple of "
                        f"'num_key_value_heads' ({kv_heads})")
    if "head_dim" in cfg:
        head_dim = read_int(cfg, "head_dim", where)
    elif hidden % heads:
        raise UserError(f"{where}: no 'head_dim', and 'hidden_size' ({hidden}) is not a multiple of "
                        f"'num_attention_heads' ({heads}); state head_dim")
    else:
        head_dim = hidden // heads
    if head_dim % 2:
        raise UserError(f"{where}: 'head_dim' must be even for RoPE, got {head_dim}")
    vocab = read_int(cfg, "vocab_size", where)
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise UserError(f"{where}: 'tie_word_embeddings' must be true or false, got {tie!r}")
    kw: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=read_int(cfg, "intermediate_size", where, default=intermediate_default),
        num_layers=read_int(cfg, "num_hidden_layers", where),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=read_float(cfg, "rms_norm_eps", where),
        max_position_embeddings=read_int(cfg, "max_position_embeddings", where, default=40960),
        tie_word_embeddings=tie,
        bos_token_id=read_token_id(cfg, "bos_token_id", vocab, where),
        eos_token_id=read_token_id(cfg, "eos_token_id", vocab, where),
    )
    kw["rope_theta"], kw["rope_scaling"] = read_rope(cfg, kw["max_position_embeddings"], where)
    return kw


def moe_kwargs(cfg: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    # transformers 5.x writes num_experts as num_local_experts (its attribute_map); published
    # checkpoints say num_experts.
    experts_key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    if experts_key not in cfg:
        raise UserError(f"{where}: missing key 'num_experts'")
    experts = read_int(cfg, experts_key, where)
    top_k = read_int(cfg, "num_experts_per_tok", where)
    if top_k > experts:
        raise UserError(f"{where}: 'num_experts_per_tok' ({top_k}) must be at most {experts_key} ({experts})")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                             and 0 <= i < num_layers for i in only):
        raise UserError(f"{where}: 'mlp_only_layers' must list layer indices in [0, {num_layers}), got {only!r}")
    return dict(
        num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=read_int(cfg, "moe_intermediate_size", where),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=read_int(cfg, "decoder_sparse_step", where, default=1),
        mlp_only_layers=tuple(only),
        router_aux_loss_coef=read_float({"router_aux_loss_coef": cfg.get("router_aux_loss_coef", 0.0)},
                                             "router_aux_loss_coef", where, allow_zero=True),
        output_router_logits=bool(cfg.get("output_router_logits", False)),
    )


def rope_parameters(args: Any) -> dict[str, Any]:
    """transformers' `rope_parameters` for args: rope_type, rope_theta and the scaling's fields."""
    s = args.rope_scaling
    out = {**(s.fields() if s else {"rope_type": "default"}), "rope_theta": args.rope_theta}
    if args.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = args.partial_rotary_factor
    return out


def rope_fields(args: Any) -> dict[str, Any]:
    """The config.json keys that state the positions: transformers 5's rope_parameters, with the
    top-level rope_theta and, for a scaled RoPE, the legacy rope_scaling that transformers 4 (and
    vLLM on it) read, holding the same fields. transformers 5 reads rope_scaling first, so it also
    replaces a stale one a checkpoint's own config.json carried into an export."""
    out: dict[str, Any] = {"rope_theta": args.rope_theta, "rope_parameters": rope_parameters(args),
                           "max_position_embeddings": args.max_position_embeddings}
    if args.rope_scaling is not None:
        out["rope_scaling"] = args.rope_scaling.fields()
    return out

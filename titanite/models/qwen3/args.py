"""Qwen3 architecture arguments, and their translation to and from HF `config.json`.

Every value that changes the math is read from config.json when one is given: titanite never
substitutes a library default for a value the checkpoint states (rope theta above all).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, fields, replace
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


@dataclass(frozen=True)
class Qwen3Args:
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128  # explicit: not always hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    tie_word_embeddings: bool = False
    # Mixture of experts (num_experts == 0 means dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False
    # Token ids carried into exported config.json (not used by the math).
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                            f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise UserError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, i: int) -> bool:
        """Qwen3-MoE's rule: sparse unless listed in mlp_only_layers or off the sparse step."""
        return (self.is_moe and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def replace(self, **kw: Any) -> "Qwen3Args":
        return replace(self, **kw)


_SUPPORTED_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _rope(cfg: dict[str, Any], max_pos: int, where: str) -> tuple[float, RopeScaling | None]:
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
    theta = _positive_float({key: theta}, key, where)
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


def with_rope_scaling(args: Qwen3Args, table: dict[str, Any]) -> Qwen3Args:
    """`args` with titanite's `model.rope_scaling` table in place of the checkpoint's scaling (an
    empty table: unchanged). yarn's original_max_position_embeddings defaults to the checkpoint's
    own yarn value, else its max_position_embeddings; for yarn, max_position_embeddings becomes
    original x factor, the length transformers and Qwen publish with YaRN."""
    if not table:
        return args
    at = "config key 'model.rope_scaling.{}'"
    theta = args.rope_theta
    if "rope_theta" in table:
        theta = _positive_float(table, "rope_theta", "config key 'model.rope_scaling'")
    s = args.rope_scaling
    scaling = parse_rope_scaling(table, at, args.max_position_embeddings, strict=True,
                                 original=s.original_max_position_embeddings if s else None)
    assert scaling is not None
    max_pos = args.max_position_embeddings
    if scaling.rope_type == "yarn":
        max_pos = max(max_pos, int(scaling.original_max_position_embeddings * scaling.factor))
    return args.replace(rope_theta=theta, rope_scaling=scaling, max_position_embeddings=max_pos)


def rope_reach(args: Qwen3Args) -> int:
    """The longest sequence the RoPE settings are meant for: max_position_embeddings, or for yarn
    original x factor, for linear and dynamic max_position_embeddings x factor (vLLM's reading)."""
    s, n = args.rope_scaling, args.max_position_embeddings
    if s is None:
        return n
    if s.rope_type == "yarn":
        return max(n, int(s.original_max_position_embeddings * s.factor))
    return int(n * s.factor)


_MISSING = object()


def _int(cfg: dict[str, Any], key: str, where: str, minimum: int = 1, default: Any = _MISSING) -> int:
    """cfg[key] as an int >= minimum. An absent key takes `default` (an error when there is none);
    a key that is present must hold a valid value: 0 or null is never quietly replaced."""
    if key not in cfg:
        if default is _MISSING:
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


def _positive_float(cfg: dict[str, Any], key: str, where: str, allow_zero: bool = False) -> float:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UserError(f"{where}: '{key}' must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise UserError(f"{where}: '{key}' must be a finite number {'>= 0' if allow_zero else '> 0'}, got {v}")
    return v


def _token_id(cfg: dict[str, Any], key: str, vocab: int, where: str) -> int | list[int] | None:
    v = cfg.get(key)
    ids = v if isinstance(v, list) else [] if v is None else [v]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
            raise UserError(f"{where}: '{key}' holds {i!r}, which is not a token id below vocab_size ({vocab})")
    return v


def from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> Qwen3Args:
    """Qwen3Args from a Qwen3 / Qwen3-MoE config.json dict. `where` names the file in errors.

    Every value is checked, naming the key, the value and the rule: sizes are positive integers,
    attention heads are a multiple of KV heads, head_dim is even, rope_theta and rms_norm_eps are
    finite and positive, MoE counts are consistent. A key that is present but 0 or null is an
    error, never a silent default."""
    model_type = cfg.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise UserError(f"{where}: model_type {model_type!r} is not a Qwen3 model "
                        f"(expected 'qwen3' or 'qwen3_moe'; architectures {_SUPPORTED_ARCHS})")
    if cfg.get("use_sliding_window"):
        raise UserError(f"{where}: use_sliding_window=true is not supported")
    if cfg.get("attention_bias"):
        raise UserError(f"{where}: attention_bias=true is not part of Qwen3 and is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (Qwen3 uses silu)")
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = _int(cfg, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise UserError(f"{where}: 'num_attention_heads' ({heads}) must be a multiple of "
                        f"'num_key_value_heads' ({kv_heads})")
    if "head_dim" in cfg:
        head_dim = _int(cfg, "head_dim", where)
    elif hidden % heads:
        raise UserError(f"{where}: no 'head_dim', and 'hidden_size' ({hidden}) is not a multiple of "
                        f"'num_attention_heads' ({heads}); state head_dim")
    else:
        head_dim = hidden // heads
    if head_dim % 2:
        raise UserError(f"{where}: 'head_dim' must be even for RoPE, got {head_dim}")
    vocab = _int(cfg, "vocab_size", where)
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise UserError(f"{where}: 'tie_word_embeddings' must be true or false, got {tie!r}")
    kw: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", where),
        num_layers=_int(cfg, "num_hidden_layers", where),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=_positive_float(cfg, "rms_norm_eps", where),
        max_position_embeddings=_int(cfg, "max_position_embeddings", where, default=40960),
        tie_word_embeddings=tie,
        bos_token_id=_token_id(cfg, "bos_token_id", vocab, where),
        eos_token_id=_token_id(cfg, "eos_token_id", vocab, where),
    )
    kw["rope_theta"], kw["rope_scaling"] = _rope(cfg, kw["max_position_embeddings"], where)
    if model_type == "qwen3_moe":
        kw.update(_moe_kwargs(cfg, kw["num_layers"], where))
    return Qwen3Args(**kw)


def _moe_kwargs(cfg: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    # transformers 5.x writes num_experts as num_local_experts (its attribute_map); published
    # checkpoints say num_experts.
    experts_key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    if experts_key not in cfg:
        raise UserError(f"{where}: missing key 'num_experts'")
    experts = _int(cfg, experts_key, where)
    top_k = _int(cfg, "num_experts_per_tok", where)
    if top_k > experts:
        raise UserError(f"{where}: 'num_experts_per_tok' ({top_k}) must be at most {experts_key} ({experts})")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                             and 0 <= i < num_layers for i in only):
        raise UserError(f"{where}: 'mlp_only_layers' must list layer indices in [0, {num_layers}), got {only!r}")
    return dict(
        num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", where),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=_int(cfg, "decoder_sparse_step", where, default=1),
        mlp_only_layers=tuple(only),
        router_aux_loss_coef=_positive_float({"router_aux_loss_coef": cfg.get("router_aux_loss_coef", 0.0)},
                                             "router_aux_loss_coef", where, allow_zero=True),
        output_router_logits=bool(cfg.get("output_router_logits", False)),
    )


def to_hf_config(args: Qwen3Args) -> dict[str, Any]:
    """A config.json dict that transformers 5.x loads as the same architecture."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if args.is_moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if args.is_moe else "qwen3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.rms_norm_eps,
        **rope_fields(args),
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "bos_token_id": args.bos_token_id,
        "eos_token_id": args.eos_token_id,
        "dtype": "float32",
    }
    if args.is_moe:
        cfg.update(
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size,
            norm_topk_prob=args.norm_topk_prob,
            decoder_sparse_step=args.decoder_sparse_step,
            mlp_only_layers=list(args.mlp_only_layers),
            router_aux_loss_coef=args.router_aux_loss_coef,
            output_router_logits=args.output_router_logits,
        )
    return cfg


def rope_parameters(args: Qwen3Args) -> dict[str, Any]:
    """transformers' `rope_parameters` for args: rope_type, rope_theta and the scaling's fields."""
    s = args.rope_scaling
    return {**(s.fields() if s else {"rope_type": "default"}), "rope_theta": args.rope_theta}


def rope_fields(args: Qwen3Args) -> dict[str, Any]:
    """The config.json keys that state the positions: transformers 5's rope_parameters, with the
    top-level rope_theta and, for a scaled RoPE, the legacy rope_scaling that transformers 4 (and
    vLLM on it) read, holding the same fields. transformers 5 reads rope_scaling first, so it also
    replaces a stale one a checkpoint's own config.json carried into an export."""
    out: dict[str, Any] = {"rope_theta": args.rope_theta, "rope_parameters": rope_parameters(args),
                           "max_position_embeddings": args.max_position_embeddings}
    if args.rope_scaling is not None:
        out["rope_scaling"] = args.rope_scaling.fields()
    return out


def arg_names() -> list[str]:
    return [f.name for f in fields(Qwen3Args)]

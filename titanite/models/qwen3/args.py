"""Qwen3 architecture arguments, and their translation to and from HF `config.json`.

Every value that changes the math is read from config.json when one is given: titanite never
substitutes a library default for a value the checkpoint states (rope theta above all).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from titanite.errors import UserError


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
        return type(self)(**{**asdict(self), **kw})


_SUPPORTED_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _rope_theta(cfg: dict[str, Any], where: str) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UserError(f"{where}: rope type '{rope_type}' is not supported (only default RoPE)")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise UserError(f"{where}: no rope_theta (neither rope_parameters.rope_theta nor rope_theta)")
    return float(theta)


def from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> Qwen3Args:
    """Qwen3Args from a Qwen3 / Qwen3-MoE config.json dict. `where` names the file in errors."""
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
    try:
        heads = int(cfg["num_attention_heads"])
        kw: dict[str, Any] = dict(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=_rope_theta(cfg, where),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )
        if model_type == "qwen3_moe":
            # transformers 5.x writes num_experts as num_local_experts (its attribute_map);
            # published checkpoints say num_experts.
            experts = cfg["num_experts"] if "num_experts" in cfg else cfg.get("num_local_experts")
            if experts is None:
                raise KeyError("num_experts")
            kw.update(
                num_experts=int(experts),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
                router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
                output_router_logits=bool(cfg.get("output_router_logits", False)),
            )
    except KeyError as e:
        raise UserError(f"{where}: missing key {e.args[0]!r}") from None
    return Qwen3Args(**kw)


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
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "max_position_embeddings": args.max_position_embeddings,
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


def arg_names() -> list[str]:
    return [f.name for f in fields(Qwen3Args)]

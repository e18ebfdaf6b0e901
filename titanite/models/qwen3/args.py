"""Qwen3 architecture arguments, and their translation to and from HF `config.json`.

Every value that changes the math is read from config.json when one is given: titanite never
substitutes a library default for a value the checkpoint states (rope theta above all). The
readers every family shares are in config_fields.py; Qwen3.5 / Qwen3-Next's fields in
hybrid_args.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from titanite.core.errors import UserError
from titanite.models.qwen3.config_fields import (  # noqa: F401 (RopeScaling, rope_parameters: re-exported)
    RopeScaling,
    base_kwargs,
    moe_kwargs,
    parse_rope_scaling,
    read_float,
    rope_fields,
    rope_parameters,
)
from titanite.models.qwen3.hybrid_args import HYBRID_MODEL_TYPES, hybrid_from_hf_config, hybrid_to_hf_config


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
    # Qwen3.5 / Qwen3-Next (hybrid_args.py). The defaults are Qwen3: every layer full attention,
    # whole-head RoPE, no output gate, `w * x` norms, no shared expert.
    model_type: str = ""  # config.json's top-level model_type ("": qwen3 / qwen3_moe, by num_experts)
    layer_types: tuple[str, ...] = ()  # per layer "linear_attention" | "full_attention"; () = all full
    linear_num_key_heads: int = 0  # Gated DeltaNet heads and widths (linear_attention layers)
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0  # RoPE turns the first head_dim * factor dims of each head
    attn_output_gate: bool = False  # q_proj also gives a sigmoid gate on the attention output
    zero_centred_norms: bool = False  # decoder RMSNorms compute x * (1 + w), w initialised at 0
    shared_expert_intermediate_size: int = 0  # MoE: one sigmoid-gated shared SwiGLU expert (0: none)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                            f"num_key_value_heads ({self.num_kv_heads})")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise UserError(f"head_dim x partial_rotary_factor must be even for RoPE, got {self.rotary_dim}")
        assert not self.layer_types or len(self.layer_types) == self.num_layers, self.layer_types

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE turns (all of them for Qwen3)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_hybrid(self) -> bool:
        """Qwen3.5 / Qwen3-Next: some layers are Gated DeltaNet (linear attention)."""
        return "linear_attention" in self.layer_types

    def layer_is_linear(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    @property
    def hf_model_type(self) -> str:
        return self.model_type or ("qwen3_moe" if self.is_moe else "qwen3")

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
        theta = read_float(table, "rope_theta", "config key 'model.rope_scaling'")
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


def from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> Qwen3Args:
    """Qwen3Args from a Qwen3 / Qwen3-MoE / Qwen3.5 / Qwen3-Next config.json dict. `where`
    names the file in errors.

    Every value is checked, naming the key, the value and the rule: sizes are positive integers,
    attention heads are a multiple of KV heads, head_dim is even, rope_theta and rms_norm_eps are
    finite and positive, MoE counts are consistent. A key that is present but 0 or null is an
    error, never a silent default."""
    model_type = cfg.get("model_type")
    if model_type in HYBRID_MODEL_TYPES:  # Qwen3.5, Qwen3-Next
        return Qwen3Args(**hybrid_from_hf_config(cfg, where))
    if model_type not in ("qwen3", "qwen3_moe"):
        raise UserError(f"{where}: model_type {model_type!r} is not a Qwen3 model "
                        f"(expected one of {('qwen3', 'qwen3_moe', *HYBRID_MODEL_TYPES)}; "
                        f"architectures {_SUPPORTED_ARCHS})")
    if cfg.get("use_sliding_window"):
        raise UserError(f"{where}: use_sliding_window=true is not supported")
    kw = base_kwargs(cfg, where)
    if model_type == "qwen3_moe":
        kw.update(moe_kwargs(cfg, kw["num_layers"], where))
    return Qwen3Args(**kw)


def to_hf_config(args: Qwen3Args) -> dict[str, Any]:
    """A config.json dict that transformers 5.x loads as the same architecture."""
    if args.hf_model_type in HYBRID_MODEL_TYPES:
        return hybrid_to_hf_config(args)
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


def arg_names() -> list[str]:
    return [f.name for f in fields(Qwen3Args)]

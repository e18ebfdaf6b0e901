"""Named Qwen3, Qwen3.5 and Qwen3-Next architectures with the published dimensions, plus small
debug flavors. The Qwen3.5 flavors are the text models (`qwen3_5_text`, `qwen3_5_moe_text`): a
published Qwen3.5 checkpoint also holds a vision tower, which a flavor (random init) has not."""

from __future__ import annotations

from titanite.core.errors import UserError, did_you_mean
from titanite.models.qwen3.args import Qwen3Args

_QWEN3_VOCAB = 151936
_QWEN3_5_VOCAB = 248320


def _hybrid(num_layers: int) -> tuple[str, ...]:
    """Qwen3.5 / Qwen3-Next's layer pattern: three Gated DeltaNet layers, then full attention."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers))


# What every Qwen3.5 / Qwen3-Next release shares: gated attention with 256-wide heads, a quarter
# of them turned by RoPE (theta 1e7), zero-centred norms, Gated DeltaNet with 128-wide heads.
_HYBRID = dict(head_dim=256, partial_rotary_factor=0.25, attn_output_gate=True, zero_centred_norms=True,
               rope_theta=1e7, max_position_embeddings=262144, linear_num_key_heads=16, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4)
# The debug flavors: the same shapes at small widths (head_dim 32, 8 rotary dims), Qwen3's
# vocabulary so the Qwen3 tokenizer works with them.
_DEBUG_HYBRID = dict(_HYBRID, hidden_size=128, num_layers=4, layer_types=_hybrid(4), num_heads=4, num_kv_heads=2,
                     head_dim=32, max_position_embeddings=4096, rope_theta=1e6, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)

FLAVORS: dict[str, Qwen3Args] = {
    # Debug flavors keep the real vocabulary so the real Qwen3 tokenizer works with them.
    "debug": Qwen3Args(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                       max_position_embeddings=4096),
    "debug-untied": Qwen3Args(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                              num_kv_heads=1, head_dim=64, tie_word_embeddings=False,
                              max_position_embeddings=4096),
    "0.6B": Qwen3Args(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                      num_kv_heads=8, tie_word_embeddings=True),
    "1.7B": Qwen3Args(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                      num_kv_heads=8, tie_word_embeddings=True),
    "4B": Qwen3Args(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                    num_kv_heads=8, tie_word_embeddings=True),
    "8B": Qwen3Args(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                    num_kv_heads=8),
    "14B": Qwen3Args(hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40,
                     num_kv_heads=8),
    "32B": Qwen3Args(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64,
                     num_kv_heads=8),
    # The 2507 releases changed RoPE theta and context length, not the shapes.
    "4B-2507": Qwen3Args(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                         num_kv_heads=8, tie_word_embeddings=True, rope_theta=5e6,
                         max_position_embeddings=262144),
    # Mixture of experts. Published dims from the released config.json files (norm_topk_prob is
    # True there, unlike the transformers config default; the aux loss is off unless
    # output_router_logits is set, as in the releases).
    "30B-A3B": Qwen3Args(hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                         num_kv_heads=4, num_experts=128, num_experts_per_tok=8,
                         moe_intermediate_size=768, norm_topk_prob=True, router_aux_loss_coef=0.001),
    "235B-A22B": Qwen3Args(hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64,
                           num_kv_heads=4, num_experts=128, num_experts_per_tok=8,
                           moe_intermediate_size=1536, norm_topk_prob=True, router_aux_loss_coef=0.001),
    # Debug MoE: every layer sparse, aux loss on, so a short run exercises the whole MoE path.
    "debug-moe": Qwen3Args(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                           max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=64, norm_topk_prob=True, router_aux_loss_coef=0.001,
                           output_router_logits=True),
    # Debug MoE with untied embeddings, which pipeline parallelism needs (the embedding and the
    # head on different stages): configs/qwen3-235b-a22b-pretrain-tiny.toml.
    "debug-moe-untied": Qwen3Args(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                                  num_kv_heads=2, head_dim=32, tie_word_embeddings=False,
                                  max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=64, norm_topk_prob=True, router_aux_loss_coef=0.001,
                                  output_router_logits=True),
    # Debug MoE with dense layers inside: sparse on every 2nd layer (1, 3) except layer 3.
    "debug-moe-mixed": Qwen3Args(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                                 num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                                 max_position_embeddings=4096, num_experts=16, num_experts_per_tok=4,
                                 moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=(3,)),
    # Qwen3.5 (published widths as in torchtitan's qwen3_5 flavors and the released config.json files)
    "qwen3.5-0.8B": Qwen3Args(**_HYBRID, model_type="qwen3_5_text", vocab_size=_QWEN3_5_VOCAB, hidden_size=1024,
                              intermediate_size=3584, num_layers=24, layer_types=_hybrid(24), num_heads=8,
                              num_kv_heads=2, linear_num_value_heads=16, tie_word_embeddings=True),
    "qwen3.5-27B": Qwen3Args(**_HYBRID, model_type="qwen3_5_text", vocab_size=_QWEN3_5_VOCAB, hidden_size=5120,
                             intermediate_size=17408, num_layers=64, layer_types=_hybrid(64), num_heads=24,
                             num_kv_heads=4, linear_num_value_heads=48),
    "qwen3.5-35B-A3B": Qwen3Args(**_HYBRID, model_type="qwen3_5_moe_text", vocab_size=_QWEN3_5_VOCAB,
                                 hidden_size=2048, intermediate_size=0, num_layers=40, layer_types=_hybrid(40),
                                 num_heads=16, num_kv_heads=2, linear_num_value_heads=32, num_experts=256,
                                 num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                 norm_topk_prob=True, router_aux_loss_coef=0.001),
    "qwen3-next-80B-A3B": Qwen3Args(**_HYBRID, model_type="qwen3_next", hidden_size=2048, intermediate_size=5120,
                                    num_layers=48, layer_types=_hybrid(48), num_heads=16, num_kv_heads=2,
                                    linear_num_value_heads=32, num_experts=512, num_experts_per_tok=10,
                                    moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                    norm_topk_prob=True, router_aux_loss_coef=0.001),
    "debug-qwen3.5": Qwen3Args(**_DEBUG_HYBRID, model_type="qwen3_5_text", intermediate_size=384,
                               tie_word_embeddings=True),
    # every layer sparse with a shared expert, aux loss on; untied, as the MoE releases are
    "debug-qwen3.5-moe": Qwen3Args(**_DEBUG_HYBRID, model_type="qwen3_5_moe_text", intermediate_size=0,
                                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                   shared_expert_intermediate_size=64, norm_topk_prob=True,
                                   router_aux_loss_coef=0.001, output_router_logits=True),
}
# Only the published Qwen3.5 flavors carry Qwen3.5's vocabulary; the rest keep Qwen3's (tokenizer).
assert all(a.vocab_size == (_QWEN3_5_VOCAB if n.startswith("qwen3.5-") else _QWEN3_VOCAB) for n, a in FLAVORS.items())


def get_flavor(name: str) -> Qwen3Args:
    if name not in FLAVORS:
        raise UserError(f"config key 'model.flavor': unknown flavor '{name}'{did_you_mean(name, FLAVORS)}; "
                        f"flavors: {', '.join(FLAVORS)}")
    return FLAVORS[name]

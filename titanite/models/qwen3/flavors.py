"""Named Qwen3 architectures with the published dimensions, plus small debug flavors."""

from __future__ import annotations

from titanite.core.errors import UserError, did_you_mean
from titanite.models.qwen3.args import Qwen3Args

_QWEN3_VOCAB = 151936

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
}
assert all(a.vocab_size == _QWEN3_VOCAB for a in FLAVORS.values())


def get_flavor(name: str) -> Qwen3Args:
    if name not in FLAVORS:
        raise UserError(f"config key 'model.flavor': unknown flavor '{name}'{did_you_mean(name, FLAVORS)}; "
                        f"flavors: {', '.join(FLAVORS)}")
    return FLAVORS[name]

"""transformers' Qwen3.5 / Qwen3-Next Gated DeltaNet layers through titanite's ops
(kernels/hf_delta.py): the same logits and gradients as unmodified transformers, and packed
documents that do not leak into each other, which transformers' own CPU path lets them do."""

from __future__ import annotations

import copy

import pytest
import torch

from titanite.kernels.hf import install
from titanite.kernels.hf_delta import DOCUMENTS_KWARG

TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, max_position_embeddings=256)


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "qwen3_5_text":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=128, **TINY))
    if family == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                          num_experts=4, num_experts_per_tok=2, **TINY))
    from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
    return Qwen3NextForCausalLM(Qwen3NextConfig(intermediate_size=128, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=32, num_experts=4,
                                                num_experts_per_tok=2, **TINY))


FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_installed_layers_equal_transformers_forward_and_backward(family):
    ref = _model(family)
    ours = copy.deepcopy(ref)
    assert install(ours)["gated_delta"] == 3  # layer_types: three linear layers, then full attention
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    out_ref, out = ref(ids, use_cache=False).logits, ours(ids, use_cache=False).logits
    assert _rel(out, out_ref) < 1e-5
    (out_ref * out_ref.detach()).sum().backward()
    (out * out_ref.detach()).sum().backward()
    # Each gradient against the largest of all: a tiny one (dt_bias) differs in its rounding, as
    # the two paths sum in different orders in fp32.
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        if "linear_attn" in name and p.grad is not None:
            assert float((q.grad - p.grad).abs().max()) / scale < 1e-5, name


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_equal_each_document_alone(family):
    ref = _model(family).eval()
    ours = copy.deepcopy(ref)
    install(ours)
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, -1)
    documents = torch.cat([torch.zeros(15), torch.ones(25)]).long().expand(2, -1)
    with torch.no_grad():
        packed = ours(ids, position_ids=positions, use_cache=False, **{DOCUMENTS_KWARG: documents}).logits
        alone = [ref(ids[:, :15], use_cache=False).logits, ref(ids[:, 15:], use_cache=False).logits]
        leaky = ref(ids, position_ids=positions, use_cache=False).logits
    assert _rel(packed[:, :15], alone[0]) < 1e-5 and _rel(packed[:, 15:], alone[1]) < 1e-5
    assert _rel(leaky[:, 15:], alone[1]) > 1e-2  # transformers' own path carries the first document over

"""The native Qwen3.5 / Qwen3-Next handle from a flavor: random init by transformers' rules, a
training forward on packed documents, an export transformers builds and agrees with, the FLOPs
of Gated DeltaNet layers."""

from __future__ import annotations

import pytest
import torch

import titanite
from tests.conftest import transformers_model
from titanite.core.config import ModelConfig
from titanite.models.flops import flops_per_token, layer_flops
from titanite.models.qwen3.flavors import FLAVORS
from titanite.models.spec import get_spec

DEBUG = ("debug-qwen3.5", "debug-qwen3.5-moe")


def built(flavor: str, seed: int = 0):
    handle = get_spec("qwen3").build(ModelConfig(spec="qwen3", flavor=flavor))
    handle.module.to_empty(device="cpu")
    handle.init_weights(0.02, seed)
    return handle


@pytest.mark.parametrize("flavor", DEBUG)
def test_random_init_follows_transformers_rules(flavor):
    handle = built(flavor)
    hf = dict(handle.hf_state_dict())
    for key, t in hf.items():
        if key.endswith(("linear_attn.norm.weight", "dt_bias")):
            assert torch.equal(t, torch.ones_like(t)), key
        elif key.endswith("norm.weight"):  # zero-centred: x * (1 + w)
            assert torch.equal(t, torch.zeros_like(t)), key
        elif key.endswith("A_log"):
            assert ((t.exp() >= 0.01 - 1e-6) & (t.exp() <= 16 + 1e-4)).all() and t.std() > 0, key
        else:
            assert 0.015 < t.std() < 0.025, key
    assert handle.supports_generation  # the cache holds the conv windows and recurrent states (test_hybrid_generate)
    assert handle.supports_document_masks


@pytest.mark.parametrize("flavor", DEBUG)
def test_training_forward_on_packed_documents(flavor):
    handle = built(flavor)
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    pos = torch.stack([torch.cat((torch.arange(10), torch.arange(14))), torch.arange(24)])
    out = handle.forward_train(dict(input_ids=ids, position_ids=pos, document_ids=docs, labels=ids))
    assert torch.isfinite(out.loss_sum)
    assert (out.aux_loss is not None) == FLAVORS[flavor].is_moe  # the MoE debug flavor has its aux loss on
    (out.loss_sum + (out.aux_loss or 0)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in handle.module.parameters())


@pytest.mark.parametrize("flavor", DEBUG)
def test_export_of_a_flavor_is_what_transformers_builds(flavor, tmp_path):
    handle = built(flavor, seed=3)
    out = titanite.save_pretrained(handle.module, tmp_path / "hf")
    ref = transformers_model(out)
    x = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = handle.module.eval()(x), ref(x).logits
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5


def test_flops_count_the_delta_rule_not_the_sequence():
    a = FLAVORS["qwen3.5-35B-A3B"]
    linear, full = 0, 3  # layer types: three Gated DeltaNet layers, then full attention
    assert layer_flops(a, linear, 65536) == layer_flops(a, linear, 1024)  # linear in the sequence
    assert layer_flops(a, full, 65536) - layer_flops(a, full, 1024) == 12 * a.num_heads * a.head_dim * 64512
    all_full = a.replace(layer_types=())
    assert flops_per_token(a, 65536) < flops_per_token(all_full, 65536)

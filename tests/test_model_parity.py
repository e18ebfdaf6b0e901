"""Native Qwen3 against transformers' Qwen3ForCausalLM (the oracle), from real HF folders."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

import titanite
from tests.conftest import TINY_VOCAB, make_hf_checkpoint

CASES = {
    "tied": dict(tie_word_embeddings=True),
    "untied": dict(tie_word_embeddings=False),
    # head_dim differs from hidden / heads (48 / 4 = 12), as in Qwen3-0.6B/4B/32B
    "head_dim_explicit": dict(head_dim=32, tie_word_embeddings=True),
    "mha": dict(num_key_value_heads=4),
    "mqa": dict(num_key_value_heads=1),
    "gqa4_rope5e6": dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=5e6),
}


def _load_both(folder):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    ours = titanite.load_pretrained(folder, spec="qwen3", dtype=torch.float32)
    return hf, ours


@pytest.mark.parametrize("case", CASES)
def test_logits_and_grads_match_transformers(tmp_path, case):
    folder = make_hf_checkpoint(tmp_path / case, **CASES[case])
    hf, ours = _load_both(folder)
    assert ours.args.rope_theta == hf.config.rope_parameters["rope_theta"]
    ids = torch.randint(0, TINY_VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    ours_logits, hf_logits = ours(ids), hf(ids).logits
    assert ours_logits.shape == (2, 33, TINY_VOCAB)
    assert (ours_logits - hf_logits).abs().max().item() <= 1e-5

    # Gradient parity: same scalar objective, compare every weight's gradient through the key map.
    g = torch.randn(hf_logits.shape, generator=torch.Generator().manual_seed(2))
    (ours_logits * g).sum().backward()
    (hf_logits * g).sum().backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    spec = titanite.models.spec.get_spec("qwen3")
    ours_grads = dict(spec.hf_state_dict(_grads_as_params(ours)))
    assert set(ours_grads) <= set(hf_grads)
    for key, grad in ours_grads.items():
        assert torch.allclose(grad, hf_grads[key], rtol=1e-4, atol=1e-6), key


def _grads_as_params(model):
    clone = type(model)(model.args)
    clone.load_state_dict({n: p.grad for n, p in model.named_parameters()}, strict=False)
    return clone


def test_rope_theta_comes_from_config_json(tmp_path):
    folder = make_hf_checkpoint(tmp_path / "m", rope_theta=5e6)
    model = titanite.load_pretrained(folder)
    assert model.args.rope_theta == 5e6
    expected = 1.0 / (5e6 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.equal(model.rotary.inv_freq, expected)


@pytest.mark.parametrize("tie", [True, False])
def test_hf_round_trip_is_bitwise_and_loads_in_transformers(tmp_path, tie):
    src = make_hf_checkpoint(tmp_path / "src", tie_word_embeddings=tie)
    (src / "generation_config.json").exists() or (src / "generation_config.json").write_text('{"do_sample": false}')
    model = titanite.load_pretrained(src)
    out = titanite.save_pretrained(model, tmp_path / "out", max_shard_mb=1)
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    original = load_file(src / "model.safetensors")
    reloaded = {}
    for f in out.glob("*.safetensors"):
        reloaded.update(load_file(f))
    assert set(reloaded) == set(original)
    for k in original:
        assert torch.equal(reloaded[k], original[k]), k
    again = titanite.load_pretrained(out)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, TINY_VOCAB, (1, 20))
    assert (hf(ids).logits - model(ids)).abs().max().item() <= 1e-5


def test_bf16_load_keeps_rope_in_fp32(tmp_path):
    folder = make_hf_checkpoint(tmp_path / "m")
    model = titanite.load_pretrained(folder, dtype=torch.bfloat16)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.rotary.inv_freq.dtype == torch.float32
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16

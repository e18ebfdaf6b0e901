"""Both backends against transformers (the oracle), from real Hugging Face folders built here:
logits and gradients, and the round trip through the Hub's layout. One matrix over (backend,
architecture); the native MoE's routing variants are in test_moe_parity.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import titanite
from tests.conftest import TINY_MOE, TINY_VOCAB, assert_grads_match, make_hf_checkpoint, transformers_model
from titanite.models.qwen3.args import from_hf_config

BACKENDS = ("qwen3", "hf")
ARCHS = {
    "dense_tied": dict(tie_word_embeddings=True),
    "dense_untied_rope5e6": dict(tie_word_embeddings=False, rope_theta=5e6),
    # head_dim differs from hidden / heads (48 / 4 = 12), as in Qwen3-0.6B/4B/32B
    "head_dim_explicit": dict(head_dim=32, tie_word_embeddings=True),
    "mha": dict(num_key_value_heads=4),
    "mqa": dict(num_key_value_heads=1),
    "gqa4": dict(num_attention_heads=8, num_key_value_heads=2),
    # a dense layer among sparse ones, and a tied head, as some MoE configs have
    "moe_mixed_tied": dict(TINY_MOE, num_hidden_layers=3, mlp_only_layers=[1], tie_word_embeddings=True),
}
ROUND_TRIP = ("dense_tied", "dense_untied_rope5e6", "moe_mixed_tied")


def token_ids(shape=(2, 33), seed=1):
    return torch.randint(0, TINY_VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def all_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_and_grads_match_transformers(tmp_path, backend, arch):
    folder = make_hf_checkpoint(tmp_path / arch, **ARCHS[arch])
    ours, ref = titanite.load_pretrained(folder, spec=backend), transformers_model(folder)
    x = token_ids()
    ours_logits, ref_logits = ours(x), ref(x).logits
    assert ours_logits.shape == (2, 33, TINY_VOCAB)
    assert (ours_logits - ref_logits).abs().max().item() <= 1e-5
    g = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(2))
    (ours_logits * g).sum().backward()
    (ref_logits * g).sum().backward()
    assert_grads_match(ours, ref)


@pytest.mark.parametrize("arch", ROUND_TRIP)
@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_is_the_hub_layout_bitwise(tmp_path, backend, arch):
    src = make_hf_checkpoint(tmp_path / "src", **ARCHS[arch])
    (src / "generation_config.json").exists() or (src / "generation_config.json").write_text('{"do_sample": false}')
    model = titanite.load_pretrained(src, spec=backend)
    out = titanite.save_pretrained(model, tmp_path / "out", max_shard_mb=1)  # several shards + index
    assert (out / "generation_config.json").is_file()
    original, exported = all_tensors(src), all_tensors(out)
    assert set(exported) == set(original)  # per-expert keys on disk, no tied head
    for key, t in original.items():
        assert torch.equal(exported[key], t), key
    config = lambda folder: json.loads((folder / "config.json").read_text())  # noqa: E731
    assert from_hf_config(config(out)) == from_hf_config(config(src))
    again = titanite.load_pretrained(out, spec=backend)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    x = token_ids((1, 20))
    assert (transformers_model(out)(x).logits - model(x)).abs().max().item() <= 1e-5


INV_FREQ = {"qwen3": lambda m: m.rotary.inv_freq, "hf": lambda m: m.hf.model.rotary_emb.inv_freq}


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_comes_from_config_json_and_stays_fp32(tmp_path, backend):
    """RoPE θ from config.json (not a library default), recomputed after the meta-device build
    (to_empty leaves it as garbage), and kept in fp32 when the weights are bf16."""
    folder = make_hf_checkpoint(tmp_path / "m", rope_theta=5e6)
    expected = 1.0 / (5e6 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.equal(transformers_model(folder).model.rotary_emb.inv_freq, expected)
    for dtype in (torch.float32, torch.bfloat16):
        model = titanite.load_pretrained(folder, spec=backend, dtype=dtype)
        assert torch.equal(INV_FREQ[backend](model), expected), dtype
        assert model(torch.tensor([[1, 2, 3]])).dtype == dtype

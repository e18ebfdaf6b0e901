"""The native Qwen3.5 / Qwen3-Next (`model.spec = "qwen3"`) against transformers, the oracle, from
real Hugging Face folders built here (tests/fixtures/hybrid.py): logits, gradients, packed
documents, the round trip through the Hub's layout, and config.json's layer_types."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import titanite
from tests.conftest import TINY_VOCAB, assert_grads_match, transformers_model
from tests.fixtures.hybrid import FAMILIES, hybrid_model, make_hybrid_checkpoint
from titanite.core.errors import UserError
from titanite.models.qwen3.args import from_hf_config, to_hf_config
from titanite.models.qwen3.flavors import FLAVORS

TEXT_FAMILIES = [f for f in FAMILIES if f != "qwen3_5"]


def token_ids(shape=(2, 37), seed=1, vocab=TINY_VOCAB):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def oracle(folder, family: str):
    """transformers' model of the folder, as its own class: the multimodal one for `qwen3_5`
    (text logits from input_ids alone), else AutoModelForCausalLM."""
    if family != "qwen3_5":
        return transformers_model(folder)
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()


def all_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> its checkpoint folder, each built once per module."""
    built: dict[str, object] = {}

    def folder(family: str):
        if family not in built:
            built[family] = make_hybrid_checkpoint(tmp_path_factory.mktemp(family), family)
        return built[family]

    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, folders):
    """(family, folder) for every family."""
    return request.param, folders(request.param)


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_logits_match_transformers(checkpoint, spec):
    """Both specs load every family's folder (a multimodal one as its text model)."""
    family, folder = checkpoint
    ours, ref = titanite.load_pretrained(folder, spec=spec), oracle(folder, family)
    x = token_ids()
    with torch.no_grad():
        ours_logits, ref_logits = ours(x), ref(input_ids=x).logits
    assert ours_logits.shape == (2, 37, TINY_VOCAB)
    assert relative(ours_logits, ref_logits) <= 1e-5


# The multimodal model's gradients are its text model's (qwen3_5_text), under other names.
@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_gradients_match_transformers(family, folders):
    folder = folders(family)
    ours, ref = titanite.load_pretrained(folder, spec="qwen3"), oracle(folder, family)
    x = token_ids((2, 21))
    ours_logits, ref_logits = ours(x), ref(input_ids=x).logits
    g = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(2))
    (ours_logits * g).sum().backward()
    (ref_logits * g).sum().backward()
    assert_grads_match(ours, ref, tol=1e-4)  # every parameter, Next's fused projections included


def test_packed_documents_compute_each_document_alone(checkpoint):
    """One row holding two documents (document_ids, positions restarting) gives each document's
    own logits: the attention is block-causal, the conv window and the recurrent state restart."""
    family, folder = checkpoint
    ours, ref = titanite.load_pretrained(folder, spec="qwen3"), oracle(folder, family)
    first, second = token_ids((1, 13), seed=3), token_ids((1, 19), seed=4)
    packed = torch.cat((first, second), dim=1)
    documents = torch.tensor([[0] * 13 + [1] * 19])
    positions = torch.cat((torch.arange(13), torch.arange(19)))[None]
    with torch.no_grad():
        logits = ours(packed, position_ids=positions, document_ids=documents)
        alone = torch.cat((ref(input_ids=first).logits, ref(input_ids=second).logits), dim=1)
    assert relative(logits, alone) <= 1e-5


def test_round_trip_is_the_hub_layout_bitwise(checkpoint, tmp_path):
    """The export holds exactly what transformers' save_pretrained wrote: the same keys (per-expert
    experts, Next's fused in_proj_qkvz / in_proj_ba, the multimodal prefix and vision tower) and
    the same tensors, bit for bit, under a config.json that reads as the same architecture."""
    family, folder = checkpoint
    model = titanite.load_pretrained(folder, spec="qwen3")
    out = titanite.save_pretrained(model, tmp_path / "out", max_shard_mb=1)
    original, exported = all_tensors(folder), all_tensors(out)
    assert set(exported) == set(original)
    for key, t in original.items():
        assert torch.equal(exported[key], t), key
    config = lambda f: json.loads((f / "config.json").read_text())  # noqa: E731
    assert from_hf_config(config(out)) == from_hf_config(config(folder))
    assert config(out).get("vision_config") == config(folder).get("vision_config")
    x = token_ids((1, 11))
    with torch.no_grad():
        assert relative(model(x), oracle(out, family)(input_ids=x).logits) <= 1e-5


# Published widths (torchtitan's qwen3_5 flavors, the released config.json files) at a few layers:
# three Gated DeltaNet layers and a full-attention one. The vocabulary and the number of experts
# are cut (they are not widths), so the test fits a CPU: 35B-A3B keeps its 2048 hidden, 16/2
# attention heads of 256, 16/32 linear heads of 128, 512-wide experts and shared expert, top 8.
PUBLISHED = {
    "qwen3.5-0.8B": dict(num_hidden_layers=4),
    "qwen3.5-35B-A3B": dict(num_hidden_layers=4, num_experts=16),
}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_published_widths_match_transformers(flavor, tmp_path):
    fields = to_hf_config(FLAVORS[flavor])
    fields.update(PUBLISHED[flavor], vocab_size=1024, layer_types=None)
    fields.pop("architectures"), fields.pop("dtype")
    model = hybrid_model(fields.pop("model_type"), **fields)
    model.save_pretrained(tmp_path)
    ours, ref = titanite.load_pretrained(tmp_path, spec="qwen3"), transformers_model(tmp_path)
    assert ours.args.replace(vocab_size=FLAVORS[flavor].vocab_size, num_layers=FLAVORS[flavor].num_layers,
                             layer_types=FLAVORS[flavor].layer_types,
                             num_experts=FLAVORS[flavor].num_experts) == FLAVORS[flavor]
    x = token_ids((1, 12), vocab=1024)
    with torch.no_grad():
        assert relative(ours(x), ref(x).logits) <= 1e-5


@pytest.mark.parametrize("family", TEXT_FAMILIES + ["qwen3_5"])
def test_unknown_layer_type_is_refused_naming_it(family, tmp_path):
    folder = make_hybrid_checkpoint(tmp_path / "m", family)
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg["text_config"] if family == "qwen3_5" else cfg
    text["layer_types"][2] = "sliding_attention"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config\.json.*'layer_types' holds 'sliding_attention' \(layer 2\)"):
        titanite.load_pretrained(folder, spec="qwen3")

"""The multimodal layout (Qwen3.5's published checkpoints): a reader shows the text model under
text-only names, and an export in that layout carries every other tensor through byte for byte
and loads as the source's class in transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.fixtures.multimodal import save_multimodal_qwen3_5
from titanite.formats.hf_weights import export_hf
from titanite.formats.layout import Layout, layout_of
from titanite.formats.safetensors_io import HFReader, read_hf_config


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    return save_multimodal_qwen3_5(tmp_path_factory.mktemp("qwen3_5_mm"))


def _stored(folder) -> dict[str, bytes]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                out[key] = (t.dtype, t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


def test_layouts_map_text_keys_both_ways():
    mm = layout_of(["model.language_model.embed_tokens.weight", "model.visual.patch_embed.proj.weight"])
    assert mm.multimodal and not layout_of(["model.embed_tokens.weight", "lm_head.weight"]).multimodal
    assert mm.to_disk("model.layers.0.mlp.up_proj.weight") == "model.language_model.layers.0.mlp.up_proj.weight"
    assert mm.to_disk("lm_head.weight") == "lm_head.weight"
    assert mm.from_disk("model.visual.blocks.0.attn.qkv.weight") is None and mm.from_disk("mtp.fc.weight") is None
    assert Layout().from_disk("model.layers.0.x") == "model.layers.0.x"


def test_reader_shows_the_text_model_and_sets_the_rest_aside(multimodal):
    with HFReader(multimodal) as reader:
        assert reader.layout.multimodal
        keys = reader.keys()
        assert "model.embed_tokens.weight" in keys and "lm_head.weight" in keys
        assert not any(k.startswith(("model.language_model.", "model.visual.")) for k in keys)
        assert reader.passthrough and all(k.startswith("model.visual.") for k in reader.passthrough)
        with safe_open(str(multimodal / "model.safetensors"), "pt") as f:
            want = f.get_tensor("model.language_model.layers.0.linear_attn.in_proj_qkv.weight")
        assert torch.equal(reader.get("model.layers.0.linear_attn.in_proj_qkv.weight"), want)
        box = reader.read("model.layers.0.linear_attn.in_proj_qkv.weight", tuple(want.shape), (2, 0), (3, 8),
                          torch.float32)
        assert torch.equal(box, want[2:5, :8])


def test_export_keeps_the_multimodal_layout_byte_for_byte(multimodal, tmp_path):
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    with HFReader(multimodal) as reader:  # the text model, changed: training touched it
        text = [(k, reader.get(k) + 0.5 if k.endswith("norm.weight") else reader.get(k)) for k in reader.keys()]
    out = export_hf(iter(text), read_hf_config(multimodal), tmp_path / "export", 1000, source_folders=[multimodal])
    before, after = _stored(multimodal), _stored(out)
    assert set(before) == set(after)
    untouched = [k for k in before if not k.startswith(("model.language_model.", "lm_head."))]
    assert untouched and all(after[k] == before[k] for k in untouched)
    changed = [k for k in before if k.startswith("model.language_model.") and k.endswith("norm.weight")]
    assert changed and all(after[k] != before[k] for k in changed)
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert type(model) is Qwen3_5ForConditionalGeneration

"""LoRA on Qwen3.5 / Qwen3-Next, both backends, the Gated DeltaNet projections included.

Native Gated DeltaNet fuses its input projections (w_qkvz, w_ba), transformers does not (Qwen3.5:
in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) or interleaves them per key head (Qwen3-Next:
in_proj_qkvz, in_proj_ba); titanite's native adapters keep one adapter per transformers module
(titanite/models/lora/native.py), so a short run trains the same losses on both backends, its
adapter folder loads in peft, and peft's model gives the logits of titanite's merged export.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import read_metrics, write_corpus
from tests.fixtures.hybrid import make_hybrid_checkpoint
from tests.fixtures.lora import STEPS, ids, lora_args, titanite_logits
from titanite.core.config import load_config
from titanite.run.trainer import Trainer

FAMILIES = {"qwen3_5_text": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
            "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj")}
SPECS = ("qwen3", "hf")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_tokenizer_dir):
    """family -> (base folder, {spec: finished LoRA run with the default targets})."""
    root = tmp_path_factory.mktemp("hybrid-lora")
    data = write_corpus(root / "data.jsonl")
    out = {}
    for family in FAMILIES:
        base = make_hybrid_checkpoint(root / family, family)
        for f in tiny_tokenizer_dir.iterdir():
            (base / f.name).write_bytes(f.read_bytes())
        done = {}
        for spec in SPECS:
            done[spec] = root / f"{family}-{spec}"
            Trainer(load_config(None, lora_args(base, data, done[spec], **{"model.spec": spec}))).train()
        out[family] = base, done
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_both_backends_train_the_same_losses(runs, family):
    _, done = runs[family]
    native, hf = ([r["loss"] for r in read_metrics(done[spec])] for spec in SPECS)
    assert len(native) == STEPS and len(set(native)) > 1
    for a, b in zip(native, hf, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (native, hf)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_default_targets_include_the_linear_attention_projections(runs, family, spec):
    _, done = runs[family]
    config = json.loads((done[spec] / "adapter" / "adapter_config.json").read_text())
    assert set(FAMILIES[family]) <= set(config["target_modules"])
    tensors = load_file(done[spec] / "adapter" / "adapter_model.safetensors")
    for name in FAMILIES[family]:  # layer 0 is a Gated DeltaNet layer; every adapter trained
        b = tensors[f"base_model.model.model.layers.0.linear_attn.{name}.lora_B.weight"]
        assert b.abs().max() > 0, name


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_the_adapter_with_the_merged_exports_logits(runs, family, spec):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, done = runs[family]
    run = done[spec]

    def load(folder):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    peft_model = PeftModel.from_pretrained(load(base), run / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(ids()).logits
        merged = load(run / "hf")(ids()).logits  # titanite's checkpoint.export_merged
        plain = load(base)(ids()).logits
    assert (merged - theirs).abs().max().item() <= 1e-5
    assert (titanite_logits(run) - theirs).abs().max().item() <= 1e-5  # the run's model, adapters unmerged
    assert (plain - theirs).abs().max().item() > 1e-3  # the adapter changes the model


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_from_the_adapter_matches_peft(runs, family):
    """The adapter folder on its base decodes (hybrid cache, native adapters unmerged) the greedy
    tokens peft's model gives with transformers' generate."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from titanite.commands.generate import Sampling, generate, load_generator

    base, done = runs[family]
    prompt = [5, 17, 42, 7, 99, 3, 11, 60]
    ours = generate(load_generator(done["qwen3"] / "adapter").model, prompt, Sampling(max_new_tokens=6))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                           done["qwen3"] / "adapter").eval()
    out = peft_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    assert ours == out[0, len(prompt):].tolist()

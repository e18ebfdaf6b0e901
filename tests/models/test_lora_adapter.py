"""The adapter a LoRA run leaves, on both backends, against peft and transformers as the oracles.

One short LoRA run per (backend, dense/MoE) is shared (tests/fixtures/lora.py). peft loads the
run's adapter folder onto transformers' base model and must give titanite's logits; peft's own
merge_and_unload must give titanite's merged export (as written at the end of the run, by
save_pretrained and by `titanite export`); the two backends' losses must agree; the checkpoint
holds only the adapters and their optimizer state; and generate, or a new run, started from the
run or its adapter folder, starts from the run's final model.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import read_metrics, run_cli
from tests.fixtures.lora import CASES, IDS, KINDS, STEPS, base_model, ids, lora_args, titanite_logits
from titanite.checkpoint import training_state
from titanite.commands.export import load_checkpoint_model
from titanite.core.config import load_config
from titanite.run.trainer import Trainer

pytest_plugins = ["tests.fixtures.lora"]


@pytest.mark.parametrize("spec,kind", CASES, ids=IDS)
def test_peft_loads_the_adapter_with_titanite_logits(runs, bases, spec, kind):
    from peft import PeftModel

    run = runs[spec, kind]
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert bool(config.get("target_parameters")) == (kind == "moe")
    tensors = load_file(run / "adapter" / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
    # The adapters really trained: every B moved off its zero init.
    assert all(t.abs().max() > 0 for k, t in tensors.items() if ".lora_B." in k)
    peft_model = PeftModel.from_pretrained(base_model(bases[kind]), run / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(ids()).logits
        plain = base_model(bases[kind])(ids()).logits
    ours = titanite_logits(run)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (plain - theirs).abs().max().item() > 1e-3  # the adapter changes the model


@pytest.mark.parametrize("spec,kind", CASES, ids=IDS)
def test_merged_export_is_peft_merge_and_loads_in_transformers(runs, bases, spec, kind):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = runs[spec, kind]
    merged = PeftModel.from_pretrained(base_model(bases[kind]), run / "adapter").merge_and_unload()
    ours = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()
    theirs = merged.state_dict()
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert (mine[key] - theirs[key]).abs().max().item() <= 1e-6, key
    with torch.no_grad():
        assert (ours(ids()).logits - merged(ids()).logits).abs().max().item() <= 1e-5


def test_save_pretrained_of_a_lora_model_writes_it_merged(runs, tmp_path):
    import titanite

    run = runs["qwen3", "moe"]
    _, handle = load_checkpoint_model(training_state.latest_checkpoint(run / "checkpoints"))
    titanite.save_pretrained(handle.module, tmp_path / "saved")
    ours, theirs = load_file(tmp_path / "saved" / "model.safetensors"), load_file(run / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_merged_weight_is_base_plus_scaled_b_a(runs, bases):
    """The dense q_proj of layer 0, by hand: W + B @ A x alpha / rank."""
    run = runs["qwen3", "dense"]
    key = "model.layers.0.self_attn.q_proj"
    a = load_file(run / "adapter" / "adapter_model.safetensors")
    base = load_file(bases["dense"] / "model.safetensors")[f"{key}.weight"]
    merged = load_file(run / "hf" / "model.safetensors")[f"{key}.weight"]
    expected = base + a[f"base_model.model.{key}.lora_B.weight"] @ a[f"base_model.model.{key}.lora_A.weight"] * (8 / 4)
    assert (merged - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_both_backends_train_the_same_losses(runs, kind):
    native = [r["loss"] for r in read_metrics(runs["qwen3", kind])]
    hf = [r["loss"] for r in read_metrics(runs["hf", kind])]
    assert len(native) == STEPS and len(set(native)) > 1
    for a, b in zip(native, hf, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a)


@pytest.mark.parametrize("spec,kind", CASES, ids=IDS)
def test_checkpoint_holds_only_adapters_and_their_optimizer_state(runs, spec, kind):
    from titanite.formats import dcp_safe

    ckpt = training_state.latest_checkpoint(runs[spec, kind] / "checkpoints")
    keys = dcp_safe.read_metadata(ckpt).state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.")]
    assert model_keys and optim_keys
    # Every model entry is an adapter factor or one of the MoE router's buffers (never a weight).
    buffers = ("router.expert_bias", "router.tokens_per_expert")
    assert all("lora_" in k or k.endswith(buffers) for k in model_keys), \
        [k for k in model_keys if "lora_" not in k][:3]
    assert any("lora_" in k for k in model_keys)
    assert all("lora_" in k for k in optim_keys)


def test_export_command_writes_adapter_and_merged(runs, tmp_path):
    run = runs["hf", "moe"]
    ckpt = training_state.latest_checkpoint(run / "checkpoints")
    proc = run_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "adapter"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged"), "--merged")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("adapter_model.safetensors",):
        assert load_file(tmp_path / "adapter" / name).keys() == load_file(run / "adapter" / name).keys()
        for k, t in load_file(tmp_path / "adapter" / name).items():
            assert torch.equal(t, load_file(run / "adapter" / name)[k]), k
    ours, theirs = load_file(tmp_path / "merged" / "model.safetensors"), load_file(run / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # the published layout: per-expert keys and the source's config.json
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in ours)


@pytest.mark.parametrize("spec,kind", [("qwen3", "moe"), ("hf", "dense")], ids=["qwen3-moe", "hf-dense"])
def test_generate_from_the_run_and_from_the_adapter(runs, bases, spec, kind):
    """The run folder (its checkpoint) and the adapter folder on its base decode the same greedy
    tokens as peft's model does with transformers' generate."""
    from peft import PeftModel

    from titanite.commands.generate import Sampling, generate, load_generator

    run = runs[spec, kind]
    prompt = [5, 17, 42, 7]
    sampling = Sampling(max_new_tokens=6)
    from_run = load_generator(run)
    from_adapter = load_generator(run / "adapter")
    a = generate(from_run.model, prompt, sampling)
    b = generate(from_adapter.model, prompt, sampling)
    peft_model = PeftModel.from_pretrained(base_model(bases[kind]), run / "adapter").eval()
    with torch.no_grad():
        out = peft_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
    assert a == b == out[0, len(prompt):].tolist()


def test_adapter_path_starts_from_an_adapter(runs, bases, data, tmp_path):
    """A run started from another run's adapter begins at that run's final model."""
    run = runs["qwen3", "dense"]
    out = tmp_path / "more"
    trainer = Trainer(load_config(None, lora_args(bases["dense"], data, out, steps=1,
                                                  **{"lora.adapter_path": run / "adapter"})))
    with torch.no_grad():
        first = trainer.model.eval()(ids())
    trainer.close()
    assert (first - titanite_logits(run)).abs().max().item() <= 1e-5

"""Training Qwen3.5 and Qwen3-Next on both backends: the same losses step by step from the same
checkpoint (native vs transformers with titanite's ops in its Gated DeltaNet layers), exports in
the source's layout (a multimodal checkpoint's vision tower and MTP weights byte for byte),
exact resume, and the parallel layouts not available for these models yet refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import read_metrics, stop_after, tiny_train_args
from tests.fixtures.hybrid import FAMILIES, make_hybrid_checkpoint
from titanite.core.config import load_config
from titanite.core.errors import UserError
from titanite.run.trainer import Trainer

MTP = "mtp.fc.weight"  # transformers drops mtp.* on load; an export must keep it


def _checkpoint(tmp_path, family: str, tokenizer_dir) -> object:
    folder = make_hybrid_checkpoint(tmp_path / "src", family)
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    if family == "qwen3_5":  # published multimodal checkpoints carry multi-token-prediction weights
        tensors = load_file(folder / "model.safetensors")
        tensors[MTP] = torch.randn(8, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _stored(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _train(args) -> Trainer:
    trainer = Trainer(load_config(None, args))
    trainer.train()
    return trainer


def _compared(row: dict) -> list[str]:
    return [k for k in row if k in ("loss", "aux_loss", "grad_norm") or k.startswith("moe/")]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_both_backends_train_the_same_and_export_the_source_layout(tmp_path, tiny_tokenizer_dir, tiny_data, family):
    folder = _checkpoint(tmp_path, family, tiny_tokenizer_dir)
    runs = {spec: tmp_path / spec for spec in ("qwen3", "hf")}
    for spec, out in runs.items():
        _train(tiny_train_args(folder, tiny_data, out, steps=20, **{"model.spec": spec, "checkpoint.interval": 0}))
    native, hf = read_metrics(runs["qwen3"]), read_metrics(runs["hf"])
    assert [r["step"] for r in native] == [r["step"] for r in hf] == list(range(1, 21))
    assert _compared(native[0]) == _compared(hf[0])
    for a, b in zip(native, hf, strict=True):
        for key in _compared(a):
            assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]) + 1e-7, (a["step"], key, a[key], b[key])
    assert native[-1]["loss"] < native[0]["loss"] - 0.5  # it trained
    source = _stored(folder)
    untouched = [k for k in source if not k.startswith(("model.", "lm_head."))
                 or k.startswith("model.visual.")]
    assert bool(untouched) == (family == "qwen3_5")
    for out in runs.values():
        exported = _stored(out / "hf")
        assert set(exported) == set(source)
        for key in untouched:  # the vision tower and MTP weights: the source's bytes, dtype included
            assert exported[key].dtype == source[key].dtype and torch.equal(exported[key], source[key]), key
        config = json.loads((out / "hf" / "config.json").read_text())
        assert config["architectures"] == json.loads((folder / "config.json").read_text())["architectures"]


def test_multimodal_export_loads_as_the_source_class(tmp_path, tiny_tokenizer_dir, tiny_data):
    import transformers

    folder = _checkpoint(tmp_path, "qwen3_5", tiny_tokenizer_dir)
    _train(tiny_train_args(folder, tiny_data, tmp_path / "run", steps=2, **{"checkpoint.interval": 0}))
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "run" / "hf")
    assert type(model) is transformers.Qwen3_5ForConditionalGeneration


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_packed_documents_train_the_same_on_both_backends(tmp_path, tiny_tokenizer_dir, tiny_data, spec):
    """Whole documents packed per window: both backends restart the convolution and the
    recurrent state at each document (the per-token equality with separate documents is held at
    the model level: tests/models/test_hybrid_parity.py and tests/kernels/test_hf_delta.py)."""
    folder = _checkpoint(tmp_path, "qwen3_next", tiny_tokenizer_dir)
    packed = {"data.packing": "documents", "data.seq_len": 96, "checkpoint.interval": 0}
    for s in ("qwen3", spec):
        _train(tiny_train_args(folder, tiny_data, tmp_path / s, steps=4, **{"model.spec": s, **packed}))
    a, b = read_metrics(tmp_path / "qwen3"), read_metrics(tmp_path / spec)
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)


@pytest.mark.parametrize("spec, family", [("qwen3", "qwen3_5_moe_text"), ("hf", "qwen3_5_text")])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, tiny_tokenizer_dir, tiny_data, spec, family):
    folder = _checkpoint(tmp_path, family, tiny_tokenizer_dir)
    args = lambda out: tiny_train_args(folder, tiny_data, out, steps=5, **{"model.spec": spec})  # noqa: E731
    _train(args(tmp_path / "full"))
    head = stop_after(Trainer(load_config(None, args(tmp_path / "split"))), 3)
    _train(args(tmp_path / "split"))
    resumed = read_metrics(tmp_path / "split")
    assert [r["step"] for r in resumed] == [4, 5]
    assert head + [r["loss"] for r in resumed] == [r["loss"] for r in read_metrics(tmp_path / "full")]


@pytest.mark.parametrize("key, what", [("parallelism.cp", "recurrent state"), ("parallelism.pp", "pipeline stages")])
def test_context_and_pipeline_parallelism_are_refused_for_now(tmp_path, tiny_data, key, what):
    from titanite.run.preflight import preflight

    cfg = load_config(None, tiny_train_args("", tiny_data, tmp_path / "run", **{
        "model.hf_path": "", "model.flavor": "debug-qwen3.5", key: 2, "parallelism.dp_shard": -1}))
    with pytest.raises(UserError, match=rf"'{key}' = 2 is not available for this model yet.*{what}"):
        preflight(cfg, world_size=2)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_activation_checkpointing_keeps_the_losses(tmp_path, tiny_tokenizer_dir, tiny_data, spec):
    """The recomputed Gated DeltaNet and attention layers, packed documents included, give the
    forward's numbers again."""
    folder = _checkpoint(tmp_path, "qwen3_next", tiny_tokenizer_dir)
    for ac in ("none", "full"):
        _train(tiny_train_args(folder, tiny_data, tmp_path / ac, steps=3, **{
            "model.spec": spec, "parallelism.activation_checkpoint": ac, "data.packing": "documents",
            "data.seq_len": 96, "checkpoint.interval": 0}))
    plain, recomputed = read_metrics(tmp_path / "none"), read_metrics(tmp_path / "full")
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in recomputed] == pytest.approx([r[key] for r in plain], rel=1e-6), key

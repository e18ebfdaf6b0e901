"""Reliability against wrong inputs (faults 4, 5, 7, 8 and 10 of docs/reliability.md): each is
refused before any work, with exit 2 and a message naming the cause, and no output folder.

4. model.safetensors.index.json entries stay inside the checkpoint folder (a hub-cache snapshot's
   links into its blobs/ are the one way out).
5. Tokenizer ids beyond the model's vocabulary.
7. Nonsense config.json values, a weight whose header dtype is not a float, a pickle-only folder.
8. Optimizer values out of range, and a NaN rope_theta blamed on config.json.
10. A FIFO as data.path, refused rather than read.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY_VOCAB, make_hf_checkpoint
from tests.fixtures.reliability import refused, train
from titanite.core.errors import UserError
from titanite.formats.safetensors_io import HFReader

pytest_plugins = ["tests.fixtures.reliability"]


def copy_of(hf, folder, skip_suffix: str = ""):
    """A copy of the reference checkpoint folder, to break."""
    folder.mkdir()
    for f in hf.iterdir():
        if not skip_suffix or f.suffix != skip_suffix:
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def edit_config(folder, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


# 4. model.safetensors.index.json can point outside the folder --------------------------------


@pytest.mark.parametrize("shard", ["../../outside.safetensors", "/etc/passwd", "link.safetensors"])
def test_4_index_entries_stay_inside_the_folder(tmp_path, tiny_tokenizer_dir, shard):
    hf = make_hf_checkpoint(tmp_path / "hf", tiny_tokenizer_dir)
    tensors = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    outside = tmp_path / "elsewhere.safetensors"
    save_file(tensors, outside, metadata={"format": "pt"})
    if shard == "link.safetensors":
        (hf / "link.safetensors").symlink_to(outside)
    weight_map = {k: shard for k in tensors}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UserError, match="outside"):
        HFReader(hf)


def test_4_hub_cache_snapshot_links_are_followed(tmp_path, tiny_tokenizer_dir):
    """The one allowed link out: a hub-cache snapshot's files point into the repo's blobs/."""
    src = make_hf_checkpoint(tmp_path / "src", tiny_tokenizer_dir)
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    with HFReader(snap) as reader:
        assert torch.equal(reader.get("model.norm.weight"), load_file(src / "model.safetensors")["model.norm.weight"])


# 5. Token ids are not checked against the vocabulary -----------------------------------------


def test_5_tokenizer_ids_beyond_the_vocabulary(tmp_path, capsys, reference):
    from tokenizers import Tokenizer

    hf, data, _ = reference
    folder = copy_of(hf, tmp_path / "hf")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(TINY_VOCAB)])  # ids run past vocab_size
    tok.save(str(folder / "tokenizer.json"))
    largest = tok.get_vocab_size(with_added_tokens=True) - 1  # ids are dense here
    assert largest >= TINY_VOCAB
    out = tmp_path / "run"
    refused(*train(capsys, folder, data, out), f"up to {largest}", f"vocab_size is {TINY_VOCAB}")
    assert not out.exists()


# 7. Nonsense config.json values are accepted ---------------------------------------------------


@pytest.mark.parametrize("key, value, fragment", [
    ("num_attention_heads", 0, "'num_attention_heads' must be >= 1, got 0"),
    ("num_hidden_layers", -1, "'num_hidden_layers' must be >= 1, got -1"),
    ("head_dim", 0, "'head_dim' must be >= 1, got 0"),
    ("num_key_value_heads", 0, "'num_key_value_heads' must be >= 1, got 0"),
    ("num_key_value_heads", 3, "must be a multiple of 'num_key_value_heads' (3)"),
    ("hidden_size", None, "'hidden_size' must be an integer, got None"),
    ("intermediate_size", -5, "'intermediate_size' must be >= 1"),
    ("rope_theta", float("nan"), "'rope_theta' must be a finite number > 0, got nan"),
    ("rms_norm_eps", -1e-6, "'rms_norm_eps' must be a finite number > 0"),
    ("max_position_embeddings", 16, "'data.seq_len' (32) exceeds the model's max_position_embeddings (16)"),
])
def test_7_nonsense_config_json_is_refused(tmp_path, capsys, reference, key, value, fragment):
    hf, data, _ = reference
    folder = copy_of(hf, tmp_path / "hf")

    def edit(config):
        config[key] = value
        if key == "rope_theta":
            config.pop("rope_parameters", None)

    edit_config(folder, edit)
    out = tmp_path / "run"
    refused(*train(capsys, folder, data, out), fragment)
    assert not out.exists()


def test_7_header_dtype_must_be_a_float_for_weights(tmp_path, capsys, reference):
    hf, data, _ = reference
    folder = copy_of(hf, tmp_path / "hf")
    raw = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["model.norm.weight"]["dtype"] = "I32"  # same 4 bytes per element, other meaning
    new = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(new) == n
    (folder / "model.safetensors").write_bytes(raw[:8] + new + raw[8 + n:])
    out = tmp_path / "run"
    refused(*train(capsys, folder, data, out), "model.norm.weight", "int32", "floating-point")
    assert not out.exists()


def test_7_pickle_only_folder_is_refused_with_how_to_convert(tmp_path, capsys, reference):
    hf, data, _ = reference
    folder = copy_of(hf, tmp_path / "hf", skip_suffix=".safetensors")
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    out = tmp_path / "run"
    refused(*train(capsys, folder, data, out), "pytorch_model.bin", "safetensors", "save_pretrained")
    assert not out.exists()


# 8. Optimizer values are not validated --------------------------------------------------------


@pytest.mark.parametrize("key, value, fragment", [
    ("training.lr", "nan", "'training.lr' must be a finite number, got nan"),
    ("training.beta1", 1.5, "'training.beta1' must be in [0, 1), got 1.5"),
    ("training.beta2", -0.1, "'training.beta2' must be in [0, 1)"),
    ("training.weight_decay", "nan", "'training.weight_decay' must be a finite number"),
    ("training.eps", -1e-8, "'training.eps' must be > 0"),
    ("training.warmup_steps", 9, "'training.warmup_steps' (9) must be at most training.steps (4)"),
    ("training.max_grad_norm", "inf", "'training.max_grad_norm' must be a finite number"),
])
def test_8_optimizer_values_are_validated(tmp_path, capsys, reference, key, value, fragment):
    hf, data, _ = reference
    out = tmp_path / "run"
    refused(*train(capsys, hf, data, out, **{key: value}), fragment)
    assert not out.exists()


def test_8_nan_rope_theta_is_blamed_on_config_json(tmp_path, capsys, reference):
    """Before: exit 3 blaming the learning rate, after work was done."""
    hf, data, _ = reference
    folder = copy_of(hf, tmp_path / "hf")
    edit_config(folder, lambda config: config["rope_parameters"].update(rope_theta=float("nan")))
    refused(*train(capsys, folder, data, tmp_path / "run"), "config.json", "rope_parameters.rope_theta")


# 10. Silent wrong inputs ----------------------------------------------------------------------


def test_10_fifo_as_data_path_is_refused_not_read(tmp_path, capsys, reference):
    hf, _, _ = reference
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    out = tmp_path / "run"
    signal.alarm(60)  # reading the FIFO would block forever
    try:
        refused(*train(capsys, hf, fifo, out), "data.path", "is a FIFO")
    finally:
        signal.alarm(0)
    assert not out.exists()

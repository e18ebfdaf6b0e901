"""The launch lines, the demo config, and user errors at the command line (exit code 2)."""

from __future__ import annotations

import json

import pytest
import transformers

from tests.conftest import REPO, make_hf_checkpoint, read_metrics, run_cli, tiny_train_args


def _losses(out):
    return [r["loss"] for r in read_metrics(out)]


@pytest.mark.slow
def test_three_launch_lines_behave_the_same(tmp_path, tiny_hf, tiny_data):
    outs = {name: tmp_path / name for name in ("cli", "module", "torchrun")}
    run_cli("train", *tiny_train_args(tiny_hf, tiny_data, outs["cli"], steps=3), check=True)
    run_cli(*tiny_train_args(tiny_hf, tiny_data, outs["module"], steps=3), module="titanite.train", check=True)
    run_cli("--nproc_per_node=1", "-m", "titanite.train", *tiny_train_args(tiny_hf, tiny_data, outs["torchrun"], steps=3),
            module="torch.distributed.run", check=True)
    assert _losses(outs["cli"]) == _losses(outs["module"]) == _losses(outs["torchrun"])
    assert len(_losses(outs["cli"])) == 3


def test_console_script_is_installed():
    script = REPO / ".venv" / "bin" / "titanite"
    if not script.exists():  # installed elsewhere: the entry point must still resolve
        script = __import__("shutil").which("titanite")
    assert script, "the `titanite` console script is not installed"


@pytest.mark.slow
def test_demo_config_smoke(tmp_path):
    """configs/demo.toml as `make train` runs it, shortened: real tokenizer, stdlib data, export."""
    out = tmp_path / "demo"
    proc = run_cli("train", "--config", "configs/demo.toml", f"--job.output_dir={out}", "--training.steps=3", "--training.warmup_steps=1",
                   "--data.max_files=30", "--checkpoint.interval=2", check=True)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 3]
    assert rows[0]["loss"] > 10  # ~ln(151936) = 11.9 at random init
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.config.vocab_size == 151936 and model.config.tie_word_embeddings
    assert (out / "hf" / "tokenizer.json").is_file()
    assert "exported Hugging Face model" in proc.stderr


def _expect_user_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in proc.stderr, (f, proc.stderr[-3000:])


def test_truncated_safetensors_names_the_file(tmp_path, tiny_hf, tiny_data):
    weights = tiny_hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    out = tmp_path / "run"
    proc = run_cli("train", *tiny_train_args(tiny_hf, tiny_data, out))
    _expect_user_error(proc, "model.safetensors", "truncated")
    assert not (out / "checkpoints").exists()


def test_missing_and_misshapen_tensors_name_the_tensor(tmp_path, tiny_tokenizer_dir, tiny_data):
    from safetensors.torch import load_file, save_file

    hf = make_hf_checkpoint(tmp_path / "m", tiny_tokenizer_dir)
    tensors = load_file(hf / "model.safetensors")
    key = "model.layers.1.self_attn.k_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != key}, hf / "model.safetensors", metadata={"format": "pt"})
    _expect_user_error(run_cli("train", *tiny_train_args(hf, tiny_data, tmp_path / "a")), key)
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    _expect_user_error(run_cli("train", *tiny_train_args(hf, tiny_data, tmp_path / "b")), key, "model.safetensors")


def test_wrong_model_type_and_missing_data(tmp_path, tiny_hf, tiny_data):
    cfg = json.loads((tiny_hf / "config.json").read_text())
    (tiny_hf / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    _expect_user_error(run_cli("train", *tiny_train_args(tiny_hf, tiny_data, tmp_path / "a")), "config.json", "llama")
    (tiny_hf / "config.json").write_text(json.dumps(cfg))
    _expect_user_error(run_cli("train", *tiny_train_args(tiny_hf, tmp_path / "nope.jsonl", tmp_path / "b")),
                       "data.path", "nope.jsonl")


def test_export_of_a_non_checkpoint_folder(tmp_path):
    _expect_user_error(run_cli("export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "x")),
                       "not a titanite checkpoint")


def test_unknown_command():
    proc = run_cli("trian")
    assert proc.returncode == 2 and "unknown command 'trian'" in proc.stderr

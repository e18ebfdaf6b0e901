"""LoRA input that titanite refuses, each with one message naming the cause (exit 2 from the
command) and nothing written or lost.

Bad [lora] settings and combinations (expert dropout, expert parallelism of the transformers
backend's expert adapters, a merged export without LoRA or of a full checkpoint); an adapter
trained on another base, with another alpha, or with a config peft would read differently; and a
resume on a changed base or with other [lora] settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import make_hf_checkpoint, read_metrics, run_cli, tiny_train_args
from tests.fixtures.lora import lora_args
from titanite.checkpoint import training_state
from titanite.commands.export import export_checkpoint
from titanite.core.config import load_config
from titanite.core.errors import UserError
from titanite.run.trainer import Trainer

pytest_plugins = ["tests.fixtures.lora"]


# -- bad input: one message, exit 2 ------------------------------------------------------------

BAD = {
    "unknown target": ({"lora.target_modules": '["q_proj", "qkv_proj"]'}, "'qkv_proj' is not a module name titanite knows; this model has: q_proj"),
    "target this model lacks": ({"lora.target_modules": '["experts.down_proj"]'}, "'experts.down_proj' is not a module this model has"),
    "rank 0": ({"lora.rank": 0}, "'lora.rank' must be a positive integer"),
    "dropout under tensor parallel": ({"parallelism.tp": 2, "lora.dropout": 0.1}, "would draw a different mask on each"),
    "no base": ({"model.hf_path": ""}, "'model.hf_path' is not set"),
    "bf16 base in fp32": ({"lora.base_dtype": "bf16"}, "a bf16 base needs bf16 compute"),
    "merged without export": ({"checkpoint.export_hf": "false"}, "'checkpoint.export_hf' is false"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_lora_settings_are_refused(case, bases, data, tmp_path):
    extra, message = BAD[case]
    with pytest.raises(UserError, match=_re(message)):
        Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "run", **extra)))
    assert not (tmp_path / "run" / "config.toml").exists()


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_dropout_on_experts_is_refused(bases, data, tmp_path, spec):
    with pytest.raises(UserError, match="MoE experts are targeted"):
        Trainer(load_config(None, lora_args(bases["moe"], data, tmp_path / "run",
                                            **{"lora.dropout": 0.1, "model.spec": spec})))


def test_export_merged_without_lora_is_refused(bases, data, tmp_path):
    with pytest.raises(UserError, match="'checkpoint.export_merged' merges LoRA adapters"):
        load_config(None, tiny_train_args(bases["dense"], data, tmp_path / "run", **{"checkpoint.export_merged": "true"}))


def test_hf_expert_parallel_with_expert_adapters_is_refused(bases, data, tmp_path):
    with pytest.raises(UserError, match="cannot be sharded by expert parallelism"):
        from titanite.run.preflight import preflight

        preflight(load_config(None, lora_args(bases["moe"], data, tmp_path / "run",
                                              **{"model.spec": "hf", "parallelism.ep": 2})), world_size=2)


def test_merged_flag_on_a_full_checkpoint_is_refused(tmp_path, bases, data):
    out = tmp_path / "full"
    Trainer(load_config(None, tiny_train_args(bases["dense"], data, out, steps=1))).train()
    with pytest.raises(UserError, match="not a LoRA run"):
        export_checkpoint(training_state.latest_checkpoint(out / "checkpoints"), tmp_path / "x", 5000, merged=True)


def test_adapter_of_another_base_is_refused(runs, bases, data, tmp_path, tiny_tokenizer_dir):
    import shutil

    adapter = runs["qwen3", "dense"] / "adapter"
    # The same architecture with other weights: titanite's adapters name their base's weights.
    same_shapes = make_hf_checkpoint(tmp_path / "same-shapes", tiny_tokenizer_dir, seed=11)
    proc = run_cli("train", *lora_args(same_shapes, data, tmp_path / "run", **{"lora.adapter_path": adapter}))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "was trained on another base" in proc.stderr
    assert not (tmp_path / "run").exists()
    # Another tool's adapter (no titanite_base.json) recording a base of another architecture.
    foreign = Path(shutil.copytree(adapter, tmp_path / "foreign"))
    (foreign / "titanite_base.json").unlink()
    other = make_hf_checkpoint(tmp_path / "other", tiny_tokenizer_dir, hidden_size=64)
    proc = run_cli("train", *lora_args(other, data, tmp_path / "run2", **{"lora.adapter_path": foreign}))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "which is not the model in model.hf_path" in proc.stderr and "hidden_size" in proc.stderr


def test_adapter_with_other_alpha_or_a_broken_config_is_refused(runs, bases, data, tmp_path):
    import shutil

    adapter = runs["qwen3", "dense"] / "adapter"
    with pytest.raises(UserError, match="alpha 8 on .* alpha 16"):
        Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "a",
                                            **{"lora.adapter_path": adapter, "lora.alpha": 16})))
    broken = Path(shutil.copytree(adapter, tmp_path / "broken"))
    config = json.loads((broken / "adapter_config.json").read_text())
    for key, value, message in (("r", 0, "r and lora_alpha must be > 0"), ("init_lora_weights", "pissa", "pissa"),
                                ("use_dora", True, "use_dora")):
        (broken / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        proc = run_cli("generate", "--model", str(broken), "--prompt", "hi", "--raw", "--max-new-tokens", "2")
        assert proc.returncode == 2 and message in proc.stderr, (key, proc.stderr[-1500:])


def test_resume_on_a_changed_base_is_refused(bases, data, tmp_path, tiny_tokenizer_dir):
    import shutil

    base = Path(shutil.copytree(bases["dense"], tmp_path / "base"))
    out = tmp_path / "run"
    Trainer(load_config(None, lora_args(base, data, out, steps=2))).train()
    make_hf_checkpoint(base, tiny_tokenizer_dir, seed=9)  # re-saved: the same shapes, other weights
    proc = run_cli("train", *lora_args(base, data, out, steps=4))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trained on another base" in proc.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2]  # nothing lost, nothing added
    with pytest.raises(UserError, match="trained on another base"):  # nor merged onto it by an export
        export_checkpoint(training_state.latest_checkpoint(out / "checkpoints"), tmp_path / "x", 5000, merged=True)


def test_resume_with_other_lora_settings_is_refused(bases, data, tmp_path):
    out = tmp_path / "run"
    Trainer(load_config(None, lora_args(bases["dense"], data, out, steps=2))).train()
    for change in ({"lora.alpha": 16}, {"lora.target_modules": '["q_proj", "v_proj"]'}):
        with pytest.raises(UserError, match="other \\[lora\\] settings"):
            Trainer(load_config(None, lora_args(bases["dense"], data, out, steps=4, **change)))
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def _re(text: str) -> str:
    import re

    return re.escape(text)

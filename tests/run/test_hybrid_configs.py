"""The Qwen3.5 / Qwen3-Next configs and their tiny twins: the same sections and keys (the
architecture from a flavor instead of a config.json folder), and each twin trains on CPU (the
SFT twins on generated toy conversations with the Qwen3 chat template) with a falling loss."""

from __future__ import annotations

import tomllib

import pytest

from tests.conftest import REPO, read_metrics, run_cli
from tests.fixtures.chat import toy_conversations, write_jsonl

CONFIGS = ["qwen3.5-27b-sft", "qwen3.5-35b-a3b-sft", "qwen3-next-80b-a3b-pretrain"]


@pytest.mark.parametrize("name", CONFIGS)
def test_tiny_twin_has_the_configs_structure(name):
    full, tiny = (tomllib.loads((REPO / "configs" / f"{name}{s}.toml").read_text()) for s in ("", "-tiny"))
    tiny["model"]["hf_path"] = tiny["model"].pop("flavor")
    assert {s: sorted(t) for s, t in full.items()} == {s: sorted(t) for s, t in tiny.items()}


@pytest.mark.parametrize("name", CONFIGS)
def test_tiny_twin_trains(name, tmp_path):
    chat = []
    if "sft" in name:
        rows = write_jsonl(tmp_path / "chat.jsonl", toy_conversations(8))
        chat = [f"--data.path={rows}", f"--eval.path={rows}"]
    out = tmp_path / "run"
    proc = run_cli("train", "--config", f"configs/{name}-tiny.toml", *chat, f"--job.output_dir={out}",
                   "--metrics.progress_bar=off", "--job.device=cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses) == 4 and sum(losses[-2:]) < sum(losses[:2]), losses

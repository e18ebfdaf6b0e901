"""What the LoRA tests share: the tiny dense and MoE bases, the data, the overrides of a short
LoRA run, and one finished LoRA run per (backend, dense/MoE), with helpers to read them.

The fixtures are session-scoped and reach the test files as a plugin: each LoRA test file names
this module in `pytest_plugins`, so the bases and the four shared runs are built once per
session however the tests are split across files (a module-scoped fixture would be rebuilt by
every file that uses it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_MOE, make_hf_checkpoint, tiny_train_args
from titanite.checkpoint import training_state
from titanite.commands.export import load_checkpoint_model
from titanite.core.config import load_config
from titanite.run.trainer import Trainer

STEPS = 4
# MoE with a dense layer too (mlp_only_layers), so dense MLP and expert adapters are both there.
MOE = dict(TINY_MOE, mlp_only_layers=[1])
KINDS = {"dense": {}, "moe": MOE}


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    from tests.conftest import write_corpus

    return write_corpus(tmp_path_factory.mktemp("lora-data") / "data.jsonl")


@pytest.fixture(scope="session")
def bases(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    return {kind: make_hf_checkpoint(tmp_path_factory.mktemp(f"base-{kind}"), tiny_tokenizer_dir, seed=3, **kw)
            for kind, kw in KINDS.items()}


def lora_args(base: Path, data: Path, out: Path, steps: int = STEPS, **extra) -> list[str]:
    opts = {"lora.enabled": "true", "lora.rank": 4, "lora.alpha": 8, "training.lr": 1e-2,
            "checkpoint.export_merged": "true", "checkpoint.interval": 2, "checkpoint.keep_latest": 0}
    opts.update(extra)
    return tiny_train_args(base, data, out, steps=steps, **opts)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, bases, data) -> dict[tuple[str, str], Path]:
    """(spec, kind) -> the output folder of a finished LoRA run."""
    root = tmp_path_factory.mktemp("lora-runs")
    out = {}
    for kind, base in bases.items():
        for spec in ("qwen3", "hf"):
            folder = root / f"{spec}-{kind}"
            Trainer(load_config(None, lora_args(base, data, folder, **{"model.spec": spec}))).train()
            out[spec, kind] = folder
    return out


CASES = [(spec, kind) for kind in KINDS for spec in ("qwen3", "hf")]
IDS = [f"{spec}-{kind}" for spec, kind in CASES]


def ids() -> torch.Tensor:
    return torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))


def titanite_logits(run: Path) -> torch.Tensor:
    _, handle = load_checkpoint_model(training_state.latest_checkpoint(run / "checkpoints"))
    with torch.no_grad():
        return handle.module.eval()(ids())


def base_model(base: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()

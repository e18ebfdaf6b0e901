"""Chat SFT and DPO on Qwen3.5 / Qwen3-Next: the objectives are the ones the Qwen3 tests hold to
transformers and TRL; here the same run on both backends (titanite's native hybrid model and
transformers' with titanite's ops in its Gated DeltaNet layers) gives the same numbers, and the
held-out evaluation runs on the hybrid model."""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics, tiny_train_args
from tests.fixtures.chat import make_chat_tokenizer, toy_conversations, write_jsonl
from tests.fixtures.hybrid import make_hybrid_checkpoint
from tests.fixtures.preference import standard_pairs
from titanite.core.config import load_config
from titanite.run.trainer import Trainer

RUNS = {  # objective -> (the data's rows, run overrides)
    "chat": (lambda: toy_conversations(repeats=4), {"data.format": "chat", "data.seq_len": 64}),
    "dpo": (standard_pairs, {"training.objective": "dpo", "data.format": "preference", "data.seq_len": 64,
                             "training.batch_size": 2, "preference.beta": 0.5}),
}


@pytest.fixture(scope="module")
def hybrid_chat_folder(tmp_path_factory):
    """A Qwen3-Next checkpoint (hybrid layers, routed and shared experts) with a chat tokenizer."""
    folder = make_hybrid_checkpoint(tmp_path_factory.mktemp("next"), "qwen3_next")
    make_chat_tokenizer(folder)
    return folder


@pytest.mark.parametrize("objective", list(RUNS))
def test_objective_runs_the_same_on_both_backends(tmp_path, hybrid_chat_folder, objective):
    rows, extra = RUNS[objective]
    data = write_jsonl(tmp_path / "data.jsonl", rows())
    metrics = {}
    for spec in ("qwen3", "hf"):
        out = tmp_path / spec
        Trainer(load_config(None, tiny_train_args(hybrid_chat_folder, data, out, steps=3, **{
            "model.spec": spec, "checkpoint.interval": 0, "eval.path": data, "eval.max_batches": 2,
            **extra}))).train()
        metrics[spec] = read_metrics(out)
    keys = [k for k in metrics["qwen3"][-1] if k in ("loss", "grad_norm", "eval_loss") or k.startswith("rewards/")]
    assert "loss" in keys and "eval_loss" in keys and (objective != "dpo" or "rewards/margins" in keys)
    for a, b in zip(metrics["qwen3"], metrics["hf"], strict=True):
        for key in keys:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)

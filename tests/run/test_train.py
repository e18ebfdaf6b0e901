"""End-to-end training on CPU with tiny models: determinism, resume, crashes, signals, export."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import transformers

import titanite
from tests.conftest import REPO, TINY_VOCAB, read_metrics, run_cli, stop_after, tiny_train_args
from titanite.checkpoint import training_state
from titanite.core.config import load_config
from titanite.core.errors import TrainingDiverged
from titanite.run.step_context import StepContext
from titanite.run.trainer import Trainer


def train_in_process(args: list[str]) -> Trainer:
    trainer = Trainer(load_config(None, args))
    trainer.train()
    return trainer


def losses(out) -> list[float]:
    return [row["loss"] for row in read_metrics(out)]


def test_metrics_checkpoints_and_export(tmp_path, tiny_hf, tiny_data):
    out = tmp_path / "run"
    trainer = train_in_process(tiny_train_args(tiny_hf, tiny_data, out, steps=6,
                                               **{"checkpoint.keep_latest": 2}))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "mem_gib"):
        assert all(key in r for r in rows), key
    assert rows[0]["lr"] == pytest.approx(5e-4) and rows[1]["lr"] == pytest.approx(1e-3)
    assert (out / "config.toml").is_file()
    assert [s for s, _ in training_state.list_checkpoints(out / "checkpoints")] == [4, 6]  # step-2 pruned
    # The export loads in transformers and gives the trained model's logits.
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, TINY_VOCAB, (2, 16))
    trainer.model.eval()
    assert (hf(ids).logits - trainer.model(ids)).abs().max().item() <= 1e-5
    assert (out / "hf" / "tokenizer.json").is_file()


def test_same_config_same_losses_bitwise(tmp_path, tiny_hf, tiny_data):
    a = train_in_process(tiny_train_args(tiny_hf, tiny_data, tmp_path / "a", steps=4))
    b = train_in_process(tiny_train_args(tiny_hf, tiny_data, tmp_path / "b", steps=4))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert a.step == b.step == 4


def test_loss_falls_from_random_init(tmp_path, tiny_hf, tiny_data):
    out = tmp_path / "run"
    train_in_process(tiny_train_args(tiny_hf, tiny_data, out, steps=30, **{"model.init": "random",
                                                                           "training.lr": 3e-3}))
    ls = losses(out)
    assert ls[-1] < ls[0] - 1.0


def test_grad_accumulation_matches_one_big_batch(tmp_path, tiny_hf, tiny_data):
    big = tmp_path / "big"
    acc = tmp_path / "acc"
    train_in_process(tiny_train_args(tiny_hf, tiny_data, big, steps=3, **{"training.batch_size": 8}))
    train_in_process(tiny_train_args(tiny_hf, tiny_data, acc, steps=3, **{"training.batch_size": 2,
                                                                          "training.global_batch_size": 8}))
    for x, y in zip(losses(big), losses(acc), strict=True):
        assert x == pytest.approx(y, rel=1e-5)


def test_resume_in_process_reproduces_uninterrupted(tmp_path, tiny_hf, tiny_data):
    full, split = tmp_path / "full", tmp_path / "split"
    train_in_process(tiny_train_args(tiny_hf, tiny_data, full, steps=6))
    first = Trainer(load_config(None, tiny_train_args(tiny_hf, tiny_data, split, steps=6)))
    head = stop_after(first, 3)
    train_in_process(tiny_train_args(tiny_hf, tiny_data, split, steps=6))  # same command: resumes at 3
    assert head + losses(split)[-3:] == losses(full)
    assert [r["step"] for r in read_metrics(split)] == [4, 5, 6]


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, tiny_hf, tiny_data, monkeypatch):
    real = StepContext.forward
    seen = {"n": 0}

    def poisoned(self, batch):
        seen["n"] += 1
        out, loss = real(self, batch)
        return out, (loss * float("nan") if seen["n"] == 3 else loss)

    monkeypatch.setattr(StepContext, "forward", poisoned)
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"loss is nan .* at step 3.*step-2"):
        train_in_process(tiny_train_args(tiny_hf, tiny_data, out, steps=6))
    assert [s for s, _ in training_state.list_checkpoints(out / "checkpoints")] == [2]
    assert max(r["step"] for r in read_metrics(out)) == 2


@pytest.mark.slow
def test_hard_kill_then_rerun_matches_uninterrupted(tmp_path, tiny_hf, tiny_data):
    full, killed = tmp_path / "full", tmp_path / "killed"
    steps = 60
    args = lambda out: ["train", *tiny_train_args(tiny_hf, tiny_data, out, steps=steps)]  # noqa: E731
    run_cli(*args(full), check=True)
    proc = subprocess.Popen([sys.executable, "-m", "titanite.cli", *args(killed)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    # Kill between checkpoints: after step 4 is saved and step 5 is logged.
    while not (killed / "metrics.jsonl").exists() or len(read_metrics(killed)) < 5:
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = [s for s, _ in training_state.list_checkpoints(killed / "checkpoints")]
    assert done and max(done) < steps, done
    run_cli(*args(killed), check=True)
    assert losses(killed) == losses(full)


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path, tiny_hf, tiny_data):
    out = tmp_path / "run"
    args = ["train", *tiny_train_args(tiny_hf, tiny_data, out, steps=400, **{"checkpoint.interval": 0})]
    proc = subprocess.Popen([sys.executable, "-m", "titanite.cli", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 3:
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in err
    (step, ckpt), = training_state.list_checkpoints(out / "checkpoints")
    assert step == max(r["step"] for r in read_metrics(out)) and step < 400
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == step


def test_export_command_matches_training_checkpoint(tmp_path, tiny_hf, tiny_data):
    out = tmp_path / "run"
    trainer = train_in_process(tiny_train_args(tiny_hf, tiny_data, out, steps=2, **{"checkpoint.export_hf": False}))
    assert not (out / "hf").exists()
    run_cli("export", "--checkpoint", str(out / "checkpoints" / "step-2"), "--out", str(tmp_path / "exp"),
            check=True)
    exported = titanite.load_pretrained(tmp_path / "exp")
    for (n, a), (_, b) in zip(trainer.model.state_dict().items(), exported.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert (tmp_path / "exp" / "tokenizer.json").is_file()


def test_bf16_mixed_precision_trains(tmp_path, tiny_hf, tiny_data):
    out = tmp_path / "run"
    trainer = train_in_process(tiny_train_args(tiny_hf, tiny_data, out, steps=3,
                                               **{"training.mixed_precision": "bf16"}))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    fp32 = tmp_path / "fp32"
    train_in_process(tiny_train_args(tiny_hf, tiny_data, fp32, steps=3))
    assert losses(out)[0] == pytest.approx(losses(fp32)[0], rel=2e-2)

"""Asynchronous checkpoints (checkpoint.async_mode = "async" | "async_pinned"): the guarantees of
docs/reliability.md, held with the write in the background.

Each test compares with a synchronous run (the oracle): the same losses bitwise, the same
tensors in every checkpoint, the same losses after a resume. kill -9 inside the background
write is in tests/checkpoint/test_fault_matrix.py; the test device's pinned staging over its own c10d
backend in tests/device/test_device_runs.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest

from tests.conftest import read_metrics, tiny_train_args
from tests.fixtures.reliability import assert_same_checkpoints, losses, refused, train
from tests.parallel.test_distributed import torchrun
from titanite.checkpoint import saving, training_state
from titanite.run.trainer import Trainer

pytest_plugins = ["tests.fixtures.reliability"]


@pytest.mark.parametrize("mode", ["async", "async_pinned"])
def test_async_run_matches_sync_bitwise_and_resumes_identically(tmp_path, capsys, reference, mode):
    hf, data, want = reference  # a synchronous 4-step run, a checkpoint every 2 steps
    sync, run = tmp_path / "sync", tmp_path / "async"
    assert train(capsys, hf, data, sync, **{"checkpoint.keep_latest": 0})[0] == 0
    code, err = train(capsys, hf, data, run, **{"checkpoint.keep_latest": 0, "checkpoint.async_mode": mode})
    assert code == 0, err[-3000:]
    assert losses(run) == want
    assert "written in the background" in err
    if mode == "async_pinned":  # the CPU has no pinned memory: said once, then as "async"
        assert err.count("has no pinned host memory") == 1, err[-3000:]
    assert_same_checkpoints(sync / "checkpoints", run / "checkpoints", [2, 4], tmp_path)
    # Resumed from the async run's step-2, with async saves again: the uninterrupted losses.
    resumed = tmp_path / "resumed"
    shutil.copytree(run / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    assert train(capsys, hf, data, resumed, **{"checkpoint.async_mode": mode})[0] == 0
    assert losses(resumed) == want[2:]


def test_write_error_in_the_background_is_reported_and_the_previous_checkpoint_kept(tmp_path, capsys, reference,
                                                                                  monkeypatch):
    from tests.fixtures.faults.inject import disk_full_after

    hf, data, want = reference
    out = tmp_path / "run"
    extra = {"checkpoint.interval": 1, "checkpoint.async_mode": "async"}
    with disk_full_after(monkeypatch, out / "checkpoints", saves_allowed=1):  # step-2's write fills the disk
        code, err = train(capsys, hf, data, out, **extra)
    refused(code, err, "no space left on the device", "step-2", str(out / "checkpoints" / "step-1"))
    assert err.count("no space left on the device") == 1, err[-3000:]  # one message, from the command
    assert max(r["step"] for r in read_metrics(out)) == 3  # stopped at the next step
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]  # no .tmp left
    assert training_state.verify(out / "checkpoints" / "step-1") == []
    assert train(capsys, hf, data, out, **extra)[0] == 0  # the user frees space and reruns
    assert losses(out)[-3:] == want[1:]


def test_sigterm_during_an_async_save_waits_for_it_and_exits_0(tmp_path, capsys, reference, monkeypatch):
    hf, data, want = reference
    out = tmp_path / "run"
    real_digest, sent = saving.file_digest, threading.Event()

    def digest_then_sigterm(path):  # the background finaliser of step-2's save, while it hashes
        if not sent.is_set():
            sent.set()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # still in flight while step 3 trains and sees the signal
        return real_digest(path)

    def step_after_the_signal(self):  # step 3 begins once the signal is on its way
        if self.step == 2:
            assert sent.wait(timeout=60)
        return real_step(self)

    real_step = Trainer.train_step
    monkeypatch.setattr(saving, "file_digest", digest_then_sigterm)
    monkeypatch.setattr(Trainer, "train_step", step_after_the_signal)
    code, err = train(capsys, hf, data, out, **{"checkpoint.async_mode": "async"})
    assert code == 0, err[-3000:]
    assert sent.is_set() and "stopped by SIGTERM at step 3" in err, err[-3000:]
    assert err.index("checkpoints/step-2 (") < err.index("stopped by SIGTERM")  # waited for it first
    assert [s for s, _ in training_state.list_checkpoints(out / "checkpoints")] == [2, 3]
    assert all(training_state.verify(out / "checkpoints" / f"step-{s}") == [] for s in (2, 3))
    monkeypatch.setattr(saving, "file_digest", real_digest)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert train(capsys, hf, data, out, **{"checkpoint.async_mode": "async"})[0] == 0
    assert losses(out) == want


@pytest.mark.slow
def test_async_saves_under_torchrun_match_sync_on_two_ranks(tmp_path, tiny_hf, tiny_data):
    """FSDP over 2 gloo ranks: the background save's own gloo group, rank 0 finalising after
    every rank wrote and hashed its shards."""
    args = tiny_train_args(tiny_hf, tiny_data, tmp_path / "x", steps=4, **{
        "training.batch_size": 2, "training.global_batch_size": 8, "checkpoint.keep_latest": 0,
        "checkpoint.export_hf": False})
    sync, run = tmp_path / "sync", tmp_path / "async"
    torchrun(2, [*args, f"--job.output_dir={sync}"])
    proc = torchrun(2, [*args, f"--job.output_dir={run}", "--checkpoint.async_mode=async", "--checkpoint.interval=1"])
    assert "written in the background" in proc.stderr
    assert losses(run) == losses(sync)
    assert [s for s, _ in training_state.list_checkpoints(run / "checkpoints")] == [1, 2, 3, 4]
    assert_same_checkpoints(sync / "checkpoints", run / "checkpoints", [2, 4], tmp_path)

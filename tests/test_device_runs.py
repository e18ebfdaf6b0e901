"""Checkpoints and several ranks on the test device `tdev` (tests/device).

- Save, kill, resume: a run SIGKILLed while saving resumes from its last complete checkpoint
  and continues bit for bit as the uninterrupted run on the device; a corrupt newest
  checkpoint is passed over for the one before it; the device's own generator is restored.
- The export on the device matches the CPU run's, and its losses the CPU's to 1e-6.
- Two and four ranks on the device (FSDP2, TP, EP), with the c10d backend the device registered
  (a Python ProcessGroup): each against the same layout on the CPU with gloo.
"""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import TINY_MOE, make_hf_checkpoint, read_metrics, tiny_train_args
from tests.device_runs import assert_same_losses, on_tdev, torchrun_on_tdev, train_on_cpu, train_on_tdev
from tests.reliability_fixtures import _corrupt_flip, assert_same_checkpoints
from tests.test_distributed import assert_same_export, torchrun

STEPS = 6


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out)}


def test_save_kill_resume_and_corrupt_fallback_on_device(tmp_path, tiny_hf, tiny_data):
    args = tiny_train_args(tiny_hf, tiny_data, tmp_path / "x", steps=STEPS, **{
        "checkpoint.interval": 2, "checkpoint.keep_latest": 0})
    ref, cpu = tmp_path / "ref", tmp_path / "cpu"
    train_on_tdev([*args, f"--job.output_dir={ref}"])
    train_on_cpu([*args, f"--job.output_dir={cpu}"])
    assert_same_losses(cpu, ref)
    assert_same_export(cpu / "hf", ref / "hf")
    want = _losses(ref)

    # SIGKILL at the first file operation of step 4's save: step-2 is the last complete one.
    killed = tmp_path / "killed"
    crash = on_tdev("--step", "4", "--kill-at", "1", "--", *args, f"--job.output_dir={killed}", "--job.device=tdev",
                    module="tests.faults.crash_run")
    assert crash.returncode == -9, crash.stderr[-3000:]
    resumed = train_on_tdev([*args, f"--job.output_dir={killed}"])
    assert "resumed from" in resumed.stderr and "step-2 at step 2" in resumed.stderr, resumed.stderr[-3000:]
    assert _losses(killed) == want  # bitwise

    # A corrupt newest checkpoint: the one before it is used, and the run still ends the same.
    fallback = tmp_path / "fallback"
    for step in (2, 4):
        shutil.copytree(ref / "checkpoints" / f"step-{step}", fallback / "checkpoints" / f"step-{step}")
    _corrupt_flip(fallback / "checkpoints" / "step-4")
    proc = train_on_tdev([*args, f"--job.output_dir={fallback}"])
    assert "cannot use step-4" in proc.stderr and "SHA-256" in proc.stderr, proc.stderr[-3000:]
    assert _losses(fallback) == {s: v for s, v in want.items() if s > 2}


@pytest.mark.parametrize("restore", [True, False])
def test_checkpoint_restores_the_device_generator(tmp_path, restore):
    flag = [] if restore else ["--without-device-restore"]
    proc = on_tdev(str(tmp_path / "ckpt"), *flag, module="tests.device_rng_check")
    assert proc.returncode == (0 if restore else 1), proc.stdout + proc.stderr[-3000:]
    assert f"tdev draws after resume equal: {restore}; cpu draws equal: True" in proc.stdout


# -- several ranks ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory, tiny_tokenizer_dir):
    return make_hf_checkpoint(tmp_path_factory.mktemp("moe"), tiny_tokenizer_dir, seed=2, **TINY_MOE,
                              output_router_logits=True, router_aux_loss_coef=0.01)


LAYOUTS = {
    # name: (checkpoint, ranks, overrides)
    "fsdp2": ("dense", 2, {}),
    "tp_hf": ("dense", 2, {"model.spec": "hf", "parallelism.tp": 2}),
    "fsdp_ep_tp": ("moe", 4, {"parallelism.ep": 2, "parallelism.tp": 2}),
}


@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.slow] if LAYOUTS[n][1] > 2 else [])
                                    for n in LAYOUTS])
def test_ranks_on_device_match_the_same_layout_on_cpu(layout, request, tmp_path, tiny_hf, moe_hf, tiny_data):
    checkpoint, ranks, extra = LAYOUTS[layout]
    hf = tiny_hf if checkpoint == "dense" else moe_hf
    args = tiny_train_args(hf, tiny_data, tmp_path / "x", steps=4, **{
        "training.batch_size": 2, "training.global_batch_size": 8, "checkpoint.interval": 0, **extra})
    torchrun(ranks, [*args, f"--job.output_dir={tmp_path / 'cpu'}", "--job.device=cpu"])
    proc = torchrun_on_tdev(ranks, [*args, f"--job.output_dir={tmp_path / 'tdev'}"])
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "backend cpu:gloo,tdev:tdevccl" in proc.stderr
    if "parallelism.ep" in extra:
        assert "on this rank (ep=2)" in proc.stderr
    assert_same_losses(tmp_path / "cpu", tmp_path / "tdev")
    assert_same_export(tmp_path / "cpu" / "hf", tmp_path / "tdev" / "hf")


def test_async_pinned_saves_on_two_device_ranks_match_sync(tmp_path, tiny_hf, tiny_data):
    """checkpoint.async_mode = "async_pinned" on the device: staged in its pinned host memory, the
    background save's collectives on a gloo group of its own beside the device's Python c10d
    backend. The same losses and checkpoint tensors as the synchronous run on the device."""
    args = tiny_train_args(tiny_hf, tiny_data, tmp_path / "x", steps=4, **{
        "training.batch_size": 2, "training.global_batch_size": 8, "checkpoint.keep_latest": 0,
        "checkpoint.export_hf": False})
    sync, run = tmp_path / "sync", tmp_path / "async"
    for out, extra in ((sync, []), (run, ["--checkpoint.async_mode=async_pinned", "--checkpoint.interval=1"])):
        proc = torchrun_on_tdev(2, [*args, f"--job.output_dir={out}", *extra])
        assert proc.returncode == 0, proc.stderr[-6000:]
    assert "backend cpu:gloo,tdev:tdevccl" in proc.stderr
    assert "checkpoints: staged in pinned host memory" in proc.stderr
    assert _losses(run) == _losses(sync)
    assert_same_checkpoints(sync / "checkpoints", run / "checkpoints", [2, 4], tmp_path)

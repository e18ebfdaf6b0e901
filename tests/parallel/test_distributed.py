"""Multi-process training under torchrun with gloo on CPU, 2 and 4 ranks.

Every layout is checked against an uninterrupted single-process run of the same config and the
same global batch (8 sequences per step): losses within 1e-5 (fp32) at every step, the same
gradient norms, and the same Hugging Face export. Resuming a checkpoint saved by 2 ranks on 1
rank or on 4 ranks (another layout) continues that run. A killed or stuck rank ends the job with
a non-zero exit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, TINY_MOE, corpus_texts, make_hf_checkpoint, read_metrics, tiny_train_args
from titanite.core.config import load_config
from titanite.run.trainer import Trainer

LOSS_TOL = 1e-5


# -- fixtures: tiny checkpoints and data, shared by the module ------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts()))
    return path


@pytest.fixture(scope="module")
def dense(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("dense"), tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def tied(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("tied"), tiny_tokenizer_dir, seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    # The auxiliary loss is on, so its data-parallel scaling is checked too.
    return make_hf_checkpoint(tmp_path_factory.mktemp("moe"), tiny_tokenizer_dir, seed=2, **TINY_MOE,
                              output_router_logits=True, router_aux_loss_coef=0.01)


def args_for(hf: Path, data: Path, out: Path, steps: int, **extra) -> list[str]:
    """2 sequences per micro-batch per rank, 8 per step on any number of data-parallel ranks."""
    opts = {"training.batch_size": 2, "training.global_batch_size": 8, "checkpoint.interval": 0}
    opts.update(extra)
    return tiny_train_args(hf, data, out, steps=steps, **opts)


def single_process(args: list[str]) -> Trainer:
    trainer = Trainer(load_config(None, args))
    trainer.train()
    return trainer


def torchrun(nproc: int, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "titanite.train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=_env())
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _env() -> dict[str, str]:
    # Two cores shared by up to four ranks: one thread each.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def assert_same_run(reference: Path, run: Path, steps: list[int]) -> None:
    ref = {r["step"]: r for r in read_metrics(reference)}
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == steps
    assert len(steps) >= 2
    for r in rows:
        expected = ref[r["step"]]
        assert abs(r["loss"] - expected["loss"]) <= LOSS_TOL, (r["step"], r["loss"], expected["loss"])
        assert r["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4), r["step"]
        if "aux_loss" in expected:
            assert r["aux_loss"] == pytest.approx(expected["aux_loss"], rel=1e-4), r["step"]


def assert_same_export(reference: Path, other: Path) -> None:
    """The same Hugging Face folder: config, tensor names and shapes; values up to fp32 noise."""
    assert json.loads((reference / "config.json").read_text()) == json.loads((other / "config.json").read_text())
    a, b = _tensors(reference), _tensors(other)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        assert (a[key] - b[key]).abs().max().item() <= LOSS_TOL, key


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def resume_dir(source: Path, step: int, dest: Path) -> Path:
    """A fresh output folder holding only `source`'s checkpoint at `step`."""
    shutil.copytree(source / "checkpoints" / f"step-{step}", dest / "checkpoints" / f"step-{step}")
    return dest


# -- FSDP on 2 ranks, then its checkpoints resumed on 1 rank and on 4 (FSDP + TP) -----------
# The model has tied embeddings: one matrix for the embedding and the head, kept in one FSDP
# group, and vocabulary-sharded once for both under tensor parallelism.

@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, tied, data):
    root = tmp_path_factory.mktemp("fsdp")
    ref, run = root / "ref", root / "fsdp"
    single_process(args_for(tied, data, ref, steps=7))
    torchrun(2, args_for(tied, data, run, steps=7, **{"checkpoint.interval": 2, "checkpoint.keep_latest": 0}))
    return root, ref, run


def test_fsdp_two_ranks_matches_single_process(fsdp_run):
    _, ref, run = fsdp_run
    assert_same_run(ref, run, list(range(1, 8)))
    assert_same_export(ref / "hf", run / "hf")


def test_checkpoint_from_two_ranks_resumes_on_one(fsdp_run, tied, data):
    root, ref, run = fsdp_run
    out = resume_dir(run, 4, root / "one")
    single_process(args_for(tied, data, out, steps=7))
    assert_same_run(ref, out, [5, 6, 7])
    assert_same_export(ref / "hf", out / "hf")


@pytest.mark.slow
def test_checkpoint_from_two_ranks_resumes_on_four_with_tensor_parallel(fsdp_run, tied, data):
    from titanite.plan import estimate

    root, ref, run = fsdp_run
    out = resume_dir(run, 2, root / "four")
    extra = {"parallelism.tp": 2}  # 2 x FSDP x 2 x TP
    proc = torchrun(4, args_for(tied, data, out, steps=7, **extra))
    assert "resumed from" in proc.stderr
    assert_same_run(ref, out, [3, 4, 5, 6, 7])
    assert_same_export(ref / "hf", out / "hf")
    # The estimator's per-rank parameter count for this layout is what rank 0 really stores.
    stored = int(re.search(r"\((\d+) stored on this rank\)", proc.stderr).group(1))
    cfg = load_config(None, args_for(tied, data, out, steps=7, **extra))
    assert estimate(cfg, 4).params == stored * 4


# -- the other layouts, each against its own single-process run -----------------------------

LAYOUTS = {
    # name: (checkpoint fixture, ranks, overrides)
    "tp": ("dense", 2, {"parallelism.tp": 2}),
    # dp_shard 4: the experts are sharded 2 ways by EP and 2 ways by FSDP; every other weight 4
    # ways by FSDP.
    "fsdp_ep": ("moe", 4, {"parallelism.ep": 2, "parallelism.activation_checkpoint": "selective"}),
    "hf_hsdp": ("dense", 4, {"model.spec": "hf", "parallelism.dp_replicate": 2,
                             "parallelism.activation_checkpoint": "full"}),
    "hf_tp_tied_head": ("tied", 2, {"model.spec": "hf", "parallelism.tp": 2}),
    # transformers' experts through the native EP code: 2 ways by EP, then 2 ways by FSDP
    "hf_ep": ("moe", 2, {"model.spec": "hf", "parallelism.ep": 2}),
    "hf_fsdp_ep": ("moe", 4, {"model.spec": "hf", "parallelism.ep": 2, "parallelism.activation_checkpoint": "selective"}),
    # MoE attention tensor-parallel, experts expert-parallel (EP x TP), FSDP over the rest
    "ep_tp": ("moe", 4, {"parallelism.ep": 2, "parallelism.tp": 2}),
    "hf_ep_tp": ("moe", 4, {"model.spec": "hf", "parallelism.ep": 2, "parallelism.tp": 2}),
}


def layout_params(layouts: dict) -> list:
    """The layouts' names as test parameters; those on more than 2 ranks marked slow."""
    return [pytest.param(name, marks=[pytest.mark.slow] if layouts[name][1] > 2 else []) for name in layouts]


def run_layout(layouts: dict, layout: str, request, tmp_path: Path, data: Path, steps: int = 5
               ) -> subprocess.CompletedProcess:
    """A layout's torchrun job against its own single-process run of the same config (less the
    [parallelism] keys): the same losses, grad norms and (without LoRA) export."""
    fixture, ranks, extra = layouts[layout]
    hf = request.getfixturevalue(fixture)
    reference = {k: v for k, v in extra.items() if not k.startswith("parallelism.")}
    single_process(args_for(hf, data, tmp_path / "ref", steps, **reference))
    proc = torchrun(ranks, args_for(hf, data, tmp_path / "run", steps, **extra))
    assert_same_run(tmp_path / "ref", tmp_path / "run", list(range(1, steps + 1)))
    if "lora.enabled" not in extra:
        assert_same_export(tmp_path / "ref" / "hf", tmp_path / "run" / "hf")
    return proc


@pytest.mark.parametrize("layout", layout_params(LAYOUTS))
def test_layout_matches_single_process(layout, request, tmp_path, data):
    proc = run_layout(LAYOUTS, layout, request, tmp_path, data)
    extra = LAYOUTS[layout][2]
    if "parallelism.ep" in extra:  # the experts really were sharded, on either backend
        assert f"on this rank (ep={extra['parallelism.ep']})" in proc.stderr + proc.stdout


# -- failures: a dead or stuck rank ends the job ---------------------------------------------

def _launch_long_run(hf: Path, data: Path, out: Path, timeout_s: int) -> subprocess.Popen:
    args = args_for(hf, data, out, steps=100000, **{"parallelism.collective_timeout_s": timeout_s,
                                                      "checkpoint.export_hf": False})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "titanite.train", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _worker_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's worker process with RANK=rank (a child of the launcher)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if parent == launcher.pid and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no worker with RANK={rank}")


def _wait_for_steps(launcher: subprocess.Popen, out: Path, steps: int, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    metrics = out / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        assert launcher.poll() is None, launcher.communicate()[0][-5000:]
        assert time.time() < deadline, "training did not start"
        time.sleep(0.1)


def _interrupt_rank_and_wait(launcher: subprocess.Popen, sig: int, limit: float) -> tuple[int, float, str]:
    victim = _worker_pid(launcher, 1)
    start = time.time()
    os.kill(victim, sig)
    try:
        output, _ = launcher.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()
        raise AssertionError(f"the job still ran {limit:.0f} s after rank 1 got {signal.Signals(sig).name}")
    return launcher.returncode, time.time() - start, output


def test_signal_to_one_rank_stops_all_ranks_with_one_checkpoint(tmp_path, dense, data):
    """SIGTERM reaches rank 1 only; rank 0 must stop at the same step instead of waiting in the
    next step's collectives, and the job ends cleanly with one checkpoint."""
    out = tmp_path / "run"
    launcher = _launch_long_run(dense, data, out, timeout_s=60)
    try:
        _wait_for_steps(launcher, out, 3)
        code, _, output = _interrupt_rank_and_wait(launcher, signal.SIGTERM, limit=90)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert code == 0, output[-5000:]
    (ckpt,) = (out / "checkpoints").iterdir()
    step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
    assert step == max(r["step"] for r in read_metrics(out)) >= 3
    assert f"stopped by SIGTERM at step {step}" in output


def test_killed_rank_ends_the_job_with_an_error(tmp_path, dense, data):
    out = tmp_path / "run"
    launcher = _launch_long_run(dense, data, out, timeout_s=60)
    try:
        _wait_for_steps(launcher, out, 3)
        code, _, _ = _interrupt_rank_and_wait(launcher, signal.SIGKILL, limit=90)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert code != 0


@pytest.mark.slow
def test_stuck_rank_ends_the_job_after_the_collective_timeout(tmp_path, dense, data):
    """A stopped (not dead) rank: the others give up after parallelism.collective_timeout_s and
    fail; torchrun then stops the job (its own grace period is 30 s before SIGKILL)."""
    out = tmp_path / "run"
    launcher = _launch_long_run(dense, data, out, timeout_s=8)
    try:
        _wait_for_steps(launcher, out, 3)
        code, elapsed, output = _interrupt_rank_and_wait(launcher, signal.SIGSTOP, limit=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert code != 0
    assert "Timed out" in output or "timed out" in output, output[-3000:]
    assert elapsed >= 8

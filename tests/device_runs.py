"""Running titanite on the test device `tdev` (tests/device), for the device tests.

The device is loaded only in the subprocesses these helpers start (`python -m
titanite_testdev.run -m MODULE ...`), never in the pytest process: once loaded, PyTorch reports
tdev as this process's accelerator, and every later test's `job.device = "auto"` would pick it.
Each run on tdev is compared with the same run on the CPU, in fp32 to 1e-6 relative.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, read_metrics, run_cli

REL_TOL = 1e-6  # fp32: the device computes with the CPU's kernels, through its own memory


# One intra-op thread in every run compared across devices: on this 2-core machine two threads
# made a CPU run of the same config differ from itself by ~6e-6 in the loss by step 2 or 3
# (thread timing; the same program, data and seed), more than REL_TOL; with one thread the
# runs repeat exactly.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def on_tdev(*args: str, module: str = "titanite.cli", env: dict | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` with the test device loaded (one thread unless `env` says)."""
    return run_cli("-m", module, *args, module="titanite_testdev.run", env={**ONE_THREAD, **(env or {})},
                   timeout=timeout)


def train_on_tdev(args: list[str], env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = on_tdev("train", *args, "--job.device=tdev", env=env)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return proc


def torchrun_on_tdev(nproc: int, args: list[str], env: dict | None = None,
                     timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "titanite_testdev.run", "-m", "titanite.train", *args, "--job.device=tdev"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)


def train_on_cpu(args: list[str]) -> subprocess.CompletedProcess:
    proc = run_cli("train", *args, "--job.device=cpu", env=ONE_THREAD)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return proc


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_same_losses(cpu: Path, device: Path, rel: float = REL_TOL, first_grad_norm_rel: float = 1e-5) -> float:
    """Every logged step of `device` against `cpu`: the same steps, and losses within `rel`.
    The first step's gradient norm within `first_grad_norm_rel` too; later ones are not
    compared: the device rounds some ops differently at the last bit (the CPU fallback makes
    strided inputs contiguous, so a GEMM may take another path), and AdamW's first update
    turns those bits of gradients near its eps into visible parameter differences that the
    next gradient norm feels (measured: 1e-4 relative at step 2 with losses still within 1e-7).
    Returns the largest relative loss difference."""
    ref, run = read_metrics(cpu), read_metrics(device)
    assert [r["step"] for r in run] == [r["step"] for r in ref] and len(ref) >= 2, (ref, run)
    first = relative(run[0]["grad_norm"], ref[0]["grad_norm"])
    assert first <= first_grad_norm_rel, f"step 1 grad_norm: tdev {run[0]['grad_norm']!r} vs cpu {ref[0]['grad_norm']!r}"
    worst = 0.0
    for a, b in zip(run, ref, strict=True):
        assert math.isfinite(a["loss"]), (a["step"], a["loss"])
        diff = relative(a["loss"], b["loss"])
        assert diff <= rel, f"step {a['step']} loss: tdev {a['loss']!r} vs cpu {b['loss']!r} ({diff:.2e} relative)"
        worst = max(worst, diff)
    print(f"largest relative loss difference tdev vs cpu: {worst:.2e}")
    return worst

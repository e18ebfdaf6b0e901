"""The fault matrix: kill -9 at random points of a checkpoint save, a full disk during a save,
and a corrupt newest checkpoint. Every case must resume to the uninterrupted run's losses,
bitwise (CPU, fp32, tiny model built here). `--async-mode async` (or async_pinned) runs the
trials with asynchronous saves, so the kills land in the background writer as well, against
the losses of a synchronous run; a killed run must leave no process of its own behind.

    .venv/bin/python -m tests.faults.matrix [--kills 20] [--seed 0] [--async-mode off]

Prints one line per trial and the survived/total counts (docs/reliability.md has the last
run's). `tests/test_fault_matrix.py` runs a short version in `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS, INTERVAL, KILL_STEP = 6, 2, 4


@dataclass
class Trial:
    case: str
    detail: str
    survived: bool
    why: str = ""


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _train_args(hf: Path, data: Path, out: Path, async_mode: str = "off") -> list[str]:
    from tests.conftest import tiny_train_args

    return tiny_train_args(hf, data, out, steps=STEPS, **{"checkpoint.interval": INTERVAL,
                                                          "checkpoint.keep_latest": 1,
                                                          "checkpoint.export_hf": False,
                                                          "checkpoint.async_mode": async_mode})


def _run(args: list[str], module: str = "titanite.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def _resume_matches(hf: Path, data: Path, out: Path, want: list[float], async_mode: str = "off") -> tuple[bool, str]:
    proc = _run(["train", *_train_args(hf, data, out, async_mode)])
    if proc.returncode != 0:
        return False, f"resume exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    got = _losses(out)
    return (got == want, "" if got == want else f"losses differ: {got} vs {want}")


def _setup(root: Path) -> tuple[Path, Path, list[float]]:
    from tests.conftest import make_hf_checkpoint, make_tiny_tokenizer, write_corpus

    hf = make_hf_checkpoint(root / "hf", make_tiny_tokenizer(root / "tok"))
    data = write_corpus(root / "data.jsonl")
    ref = root / "reference"
    proc = _run(["train", *_train_args(hf, data, ref)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return hf, data, _losses(ref)


def kill_trials(root: Path, hf: Path, data: Path, want: list[float], kills: int, seed: int,
                async_mode: str = "off") -> list[Trial]:
    count_file = root / "count"
    counted = root / "counted"
    proc = _run(["--step", str(KILL_STEP), "--count-file", str(count_file), "--",
                 *_train_args(hf, data, counted, async_mode)], module="tests.faults.crash_run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads(count_file.read_text())
    phases = _phases(events)
    rng = random.Random(seed)
    order = rng.sample(phases, len(phases))
    case = "kill -9 in a save" + ("" if async_mode == "off" else f" ({async_mode})")
    trials = []
    for i in range(kills):
        # Stratified: every phase of the save once (a shard's writes, its fsync, the manifest,
        # the rename, the pruning...) in a seeded order, then phases at random; a random point
        # inside the phase.
        first, last, label = order[i] if i < len(order) else rng.choice(phases)
        k = rng.randint(first, last)
        detail = f"op {k}/{len(events)} ({label})"
        out, children = root / f"kill-{i}", root / f"children-{i}"
        proc = _run(["--step", str(KILL_STEP), "--kill-at", str(k), "--children-file", str(children), "--",
                     *_train_args(hf, data, out, async_mode)], module="tests.faults.crash_run")
        if proc.returncode != -9:
            trials.append(Trial(case, detail, False, f"the run was not killed (exit {proc.returncode})"))
            continue
        alive = _still_alive(json.loads(children.read_text()))
        if alive:
            trials.append(Trial(case, detail, False, f"processes {alive} of the killed run are still alive"))
            continue
        ok, why = _resume_matches(hf, data, out, want, async_mode)
        trials.append(Trial(case, detail, ok, why))
        shutil.rmtree(out, ignore_errors=True)
    return trials


def _still_alive(pids: list[int], grace_s: float = 2.0) -> list[int]:
    """Those of `pids` still running `grace_s` after their parent was killed."""
    deadline = time.time() + grace_s
    while True:
        alive = [p for p in pids if Path(f"/proc/{p}").exists()
                 and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def _phases(events: list[str]) -> list[tuple[int, int, str]]:
    """Runs of operations on one file (1-based first and last index, label), in save order."""
    phases: list[tuple[int, int, str]] = []
    for i, event in enumerate(events, start=1):
        kind, _, name = event.partition(" ")
        label = f"writing {name}" if kind in ("open", "write", "wrote") else f"{kind} {name}".strip()
        if phases and phases[-1][2] == label:
            phases[-1] = (phases[-1][0], i, label)
        else:
            phases.append((i, i, label))
    return phases


def disk_full_trial(root: Path, hf: Path, data: Path, want: list[float], async_mode: str = "off") -> Trial:
    """A real full disk when this process may mount a tmpfs (sized so the second save cannot
    fit), else a patched write (tests/faults/inject.disk_full_after)."""
    mnt = root / "tmpfs"
    mnt.mkdir()
    one = sum(f.stat().st_size for f in (root / "reference" / "checkpoints" / f"step-{STEPS}").iterdir())
    size_kb = int(1.5 * one) // 1024 + 64  # room for one checkpoint and the run's small files, not two
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        return Trial("disk full during a save", "no tmpfs (mount not permitted)", False, "skipped")
    try:
        out = mnt / "run"
        proc = _run(["train", *_train_args(hf, data, out, async_mode)])
        ckpts = sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").is_dir() else []
        if proc.returncode != 2 or "no space left" not in proc.stderr or any(c.startswith(".tmp") for c in ckpts):
            return Trial("disk full during a save", f"tmpfs {size_kb} KiB", False,
                         f"exit {proc.returncode}, checkpoints {ckpts}: {proc.stderr.strip().splitlines()[-1:]}")
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)  # the user frees space
        ok, why = _resume_matches(hf, data, out, want, async_mode)
        return Trial("disk full during a save", f"tmpfs {size_kb} KiB, then enlarged; kept {ckpts}", ok, why)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def corrupt_trial(root: Path, hf: Path, data: Path, want: list[float], async_mode: str = "off") -> Trial:
    """Flip one byte in the newest checkpoint of a finished run; the rerun must fall back to the
    previous checkpoint, retrain the last step and log the same losses."""
    out = root / "corrupt"
    args = _train_args(hf, data, out, async_mode)
    proc = _run(["train", *args, "--checkpoint.interval=1", "--checkpoint.keep_latest=3"])
    if proc.returncode != 0:
        return Trial("corrupt newest checkpoint", "", False, f"first run exited {proc.returncode}")
    shard = next((out / "checkpoints" / f"step-{STEPS}").glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0x5A
    shard.write_bytes(bytes(raw))
    proc = _run(["train", *args])
    if proc.returncode != 0 or f"cannot use step-{STEPS}" not in proc.stderr:
        return Trial("corrupt newest checkpoint", f"one byte flipped in step-{STEPS}", False,
                     f"exit {proc.returncode}; no fallback logged")
    got = _losses(out)
    return Trial("corrupt newest checkpoint", f"one byte flipped in step-{STEPS}", got == want,
                 "" if got == want else f"losses differ: {got} vs {want}")


def main(argv: list[str] | None = None) -> list[Trial]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-disk", action="store_true")
    parser.add_argument("--skip-corrupt", action="store_true")
    parser.add_argument("--async-mode", default="off", choices=("off", "async", "async_pinned"),
                        help="checkpoint.async_mode of the kill trials (the reference run saves synchronously)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf, data, want = _setup(root)
        trials = kill_trials(root, hf, data, want, args.kills, args.seed, args.async_mode)
        if not args.skip_disk:
            trials.append(disk_full_trial(root, hf, data, want, args.async_mode))
        if not args.skip_corrupt:
            trials.append(corrupt_trial(root, hf, data, want, args.async_mode))
    for t in trials:
        print(f"{'survived' if t.survived else 'FAILED  '}  {t.case}: {t.detail}{'  ' + t.why if t.why else ''}")
    by_case: dict[str, list[bool]] = {}
    for t in trials:
        by_case.setdefault(t.case, []).append(t.survived)
    for case, results in by_case.items():
        print(f"{case}: {sum(results)}/{len(results)} survived")
    return trials


if __name__ == "__main__":
    results = main()
    sys.exit(0 if all(t.survived for t in results) else 1)

"""No process outlives its run (titanite/core/procs.py): the processes a command starts die with it,
however it dies, SIGKILL included, and a run that ends normally leaves none behind.

Oracle: the processes themselves. Each command runs with a marker in its environment, which
every process it starts inherits (multiprocessing's forkserver and resource tracker, the
workers, spawned ranks), so `_marked` finds them wherever they end up, reparented or not. After
the command is killed, none may remain. Linux only: elsewhere nothing sets the death signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, corpus_texts, read_metrics, tiny_train_args

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")

MARK = "TITANITE_TEST_PROCS"
GONE_WITHIN_S = 5.0
# W&B's own helper processes (wandb-core, wandb-symon) watch for their parent's death and take
# up to about 4 s to notice it.
TRACKERS_GONE_WITHIN_S = 15.0
# What the environment may say to the trackers: cleared, so they stay local and offline.
TRACKER_ENV = ("WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI", "TRACKIO_DIR", "TRACKIO_SPACE_ID",
               "TRACKIO_SERVER_URL")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its entry waits to be reaped


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _descendants(pid: int) -> list[int]:
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids = [int(p) for p in children.read_text().split()]
        except OSError:
            continue
        for child in pids:
            found += [child, *_descendants(child)]
    return found


def _marked(mark: str) -> list[int]:
    """Every live process whose environment carries `mark` (the command's and all it started)."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _wait_until(what: str, cond, timeout: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := cond()):
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the command ended (exit {proc.returncode}) before {what}")
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")


def _survivors(mark: str, within: float = GONE_WITHIN_S) -> list[str]:
    """Wait up to `within` seconds for every marked process to go; the ones left, described."""
    deadline = time.monotonic() + within
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [f"{pid}: {_cmdline(pid)[:160]}" for pid in left]


@pytest.fixture
def start(tmp_path):
    """Start `python -m MODULE ARGS` with a fresh marker, its output to a file (`output(proc)`; a
    pipe would stay open as long as any survivor holds it); afterwards, whatever a failed test
    left is killed, so no test leaves processes to the next."""
    marks = []

    def start(*args: str, module: str = "titanite.cli", env: dict | None = None) -> tuple[subprocess.Popen, str]:
        mark = uuid.uuid4().hex
        marks.append(mark)
        full_env = {k: v for k, v in os.environ.items() if k not in TRACKER_ENV}
        full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", MARK: mark, **(env or {})})
        with open(tmp_path / f"{mark}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=full_env,
                                    stdout=log, stderr=subprocess.STDOUT)
        proc.log = tmp_path / f"{mark}.log"
        return proc, mark

    yield start
    for mark in marks:
        for pid in _marked(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def output(proc: subprocess.Popen) -> str:
    return proc.log.read_text(errors="replace")


def _prepare_config(tmp_path: Path, tokenizer: Path, docs: int) -> Path:
    texts = corpus_texts(200)
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": texts[i % len(texts)]}) + "\n" for i in range(docs)))
    config = tmp_path / "run.toml"
    config.write_text(f'[data]\npath = "{src}"\ntokenizer = "{tokenizer}"\n')
    return config


def _forkserver_and_workers(pid: int) -> list[int]:
    """The forkserver and its workers among `pid`'s descendants (the server first)."""
    return [p for p in _descendants(pid) if "multiprocessing.forkserver" in _cmdline(p)]


def test_die_with_parent_arms_and_closes_the_race():
    """Armed with the right parent pid, a child lives on and is killed when its parent dies; told
    another pid (its parent died before it could arm), it kills itself at once."""
    code = ("import os, sys, time; from titanite.core.procs import die_with_parent; "
            "print(die_with_parent(int(sys.argv[1])), flush=True); time.sleep(30)")
    wrong = subprocess.run([sys.executable, "-c", code, "1"], cwd=REPO, capture_output=True, text=True, timeout=30)
    if os.getpid() != 1:
        assert wrong.returncode == -signal.SIGKILL, wrong.stdout + wrong.stderr
    # A middle process arms a grandchild to itself, then is killed: the grandchild goes with it.
    middle = subprocess.Popen([sys.executable, "-c",
                               "import os, subprocess, sys; "
                               f"c = subprocess.Popen([sys.executable, '-c', {code!r}, str(os.getpid())], "
                               "stdout=subprocess.PIPE, text=True); "
                               "print(c.pid, c.stdout.readline().strip(), flush=True); c.wait()"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    pid = 0
    try:
        pid, armed = (int(w) if w.isdigit() else w for w in middle.stdout.readline().split())
        assert armed == "True" and _alive(pid)
        middle.kill()
        middle.wait()
        _wait_until("the armed child is gone", lambda: not _alive(pid), GONE_WITHIN_S)
    finally:
        middle.kill()
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("victim", ["command", "forkserver"])
def test_a_killed_prepare_leaves_no_process(tmp_path, tiny_tokenizer_dir, start, victim):
    """kill -9 of `data prepare --workers 2` while its workers tokenize: the forkserver, both
    workers and the resource tracker go too (before: all four ran on, for good). kill -9 of the
    forkserver, the command stopped meanwhile (so it cannot end the workers itself), takes the
    workers with it; then the command is killed too."""
    config = _prepare_config(tmp_path, tiny_tokenizer_dir, docs=60_000)  # ~10 MB: several seconds
    proc, mark = start("data", "prepare", "--config", str(config), "--out", str(tmp_path / "store"),
                       "--workers", "2")
    try:
        server, *workers = _wait_until("the forkserver and both workers run",
                                       lambda: len(found := _forkserver_and_workers(proc.pid)) >= 3 and found,
                                       timeout=60, proc=proc)
        _wait_until("tokens come back from the workers",
                    lambda: any(f.stat().st_size for f in tmp_path.glob("store.tmp-*/*.bin")), timeout=30, proc=proc)
        seen = _marked(mark)
        assert {server, *workers} <= set(seen), seen
        if victim == "command":
            proc.kill()
        else:
            # Not let go on afterwards: a worker killed while its result fills the pipe this
            # stopped process does not read leaves half a message, which the pool's reader
            # thread then waits on for good (CPython's ProcessPoolExecutor, as of 3.11).
            proc.send_signal(signal.SIGSTOP)
            os.kill(server, signal.SIGKILL)
            _wait_until("the workers die with their forkserver", lambda: not any(map(_alive, workers)), GONE_WITHIN_S)
            proc.kill()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert _survivors(mark) == [], f"still running after kill -9 of the {victim}"
    assert not (tmp_path / "store").exists()


def test_a_prepare_that_ends_leaves_no_process(tmp_path, tiny_tokenizer_dir, start):
    config = _prepare_config(tmp_path, tiny_tokenizer_dir, docs=2_000)
    proc, mark = start("data", "prepare", "--config", str(config), "--out", str(tmp_path / "store"),
                       "--workers", "2")
    proc.wait(timeout=120)
    assert proc.returncode == 0 and "2 workers" in output(proc), output(proc)[-3000:]
    assert _survivors(mark) == []


def test_a_killed_device_check_leaves_no_rank(tmp_path, start):
    """kill -9 of `device check --nproc 2` once its ranks have joined the process group: no rank
    goes on with its collectives (none writes its report) and none is left (before: both ran to the
    end without their parent). Ranks still starting when it dies see their parent gone and stop."""
    proc, mark = start("-m", "titanite.cli", "device", "check", "--device", "tdev", "--nproc", "2",
                       module="titanite_testdev.run", env={"TMPDIR": str(tmp_path)})
    try:
        store = _wait_until("a rank joins the process group",
                            lambda: next(iter(tmp_path.glob("titanite-device-check-*/store")), None),
                            timeout=120, proc=proc)
        reports_before = sorted(p.name for p in store.parent.glob("rank*.json"))
        ranks = [p for p in _descendants(proc.pid) if "multiprocessing.spawn" in _cmdline(p)]
        assert len(ranks) == 2, [_cmdline(p) for p in _descendants(proc.pid)]
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert _survivors(mark) == []
    if reports_before == []:  # the usual case: killed before either rank finished
        assert sorted(p.name for p in store.parent.glob("rank*.json")) == [], "a rank ran on after its parent died"


def test_a_killed_training_leaves_no_process(tmp_path, tiny_hf, tiny_data, start):
    """kill -9 of a training run with the trackers (W&B starts service processes, wandb-core and
    wandb-symon, which watch for their parent's death themselves; MLflow and trackio only
    threads), asynchronous checkpoints (a writer thread) and the prefetch thread, while it trains
    and saves: nothing it started is left. A guard: none of these needed a change."""
    out = tmp_path / "out"
    args = tiny_train_args(tiny_hf, tiny_data, out, steps=100_000, **{
        "metrics.trackers": "[wandb, mlflow, trackio]", "checkpoint.async_mode": "async",
        "checkpoint.interval": 2, "checkpoint.export_hf": False, "data.prefetch": 2})
    proc, mark = start("train", *args)
    try:
        _wait_until("two asynchronous checkpoints are saved and W&B's service runs",
                    lambda: len(list((out / "checkpoints").glob("step-*"))) >= 2
                    and any("wandb-core" in _cmdline(p) for p in _marked(mark)), timeout=120, proc=proc)
        assert len(read_metrics(out)) >= 2
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert _survivors(mark, TRACKERS_GONE_WITHIN_S) == []

"""Reliability of the run's folder and the storage under it (faults 6 and 9 of docs/reliability.md).

6. One run per output_dir: a second run on a folder a live run holds exits 2 at once, the ranks
   of the holding job pass the preflight check, and the lock of a killed run does not block.
9. File-system faults end in one message, not a traceback: an output_dir that is a file or is
   read-only, and a disk that fills during a save (the previous checkpoint kept, resume exact);
   storage errors name their cause.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fixtures.reliability import losses, refused, train
from titanite.checkpoint import training_state
from titanite.run.runlock import RunLock

pytest_plugins = ["tests.fixtures.reliability"]


# 6. Two runs can share one output_dir --------------------------------------------------------


def test_6_second_run_on_a_held_folder_exits_at_once(tmp_path, capsys, reference):
    hf, data, _ = reference
    out = tmp_path / "run"
    held = RunLock(out).acquire()  # a live run holds the folder
    try:
        refused(*train(capsys, hf, data, out), "in use by another titanite run", f"pid {os.getpid()}",
                socket.gethostname())
        assert sorted(p.name for p in out.iterdir()) == [".titanite.lock"]
    finally:
        held.release()


def test_6_ranks_of_the_holding_job_pass_the_preflight_check(tmp_path, monkeypatch):
    """A rank whose preflight runs after its own rank 0 took the lock is not a second run; a
    process of another torchrun job, or of none, still is."""
    from titanite.core.errors import UserError
    from titanite.run.runlock import check_free

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    held = RunLock(tmp_path).acquire()
    try:
        check_free(tmp_path)
        for other in ("job-b", ""):
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", other)
            with pytest.raises(UserError, match="in use by another titanite run"):
                check_free(tmp_path)
    finally:
        held.release()


def test_6_lock_of_a_killed_run_does_not_block(tmp_path, capsys, reference):
    hf, data, want = reference
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from titanite.run.runlock import RunLock; "
                               f"RunLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(600)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (out / ".titanite.lock").exists()  # left behind by the kill
    assert train(capsys, hf, data, out)[0] == 0
    assert losses(out) == want
    assert not (out / ".titanite.lock").exists()


# 9. File-system faults end in tracebacks -----------------------------------------------------


def test_9_output_dir_that_is_a_file(tmp_path, capsys, reference):
    hf, data, _ = reference
    out = tmp_path / "run"
    out.write_text("a file")
    refused(*train(capsys, hf, data, out), "job.output_dir", "is not a folder")
    assert out.read_text() == "a file"


def test_9_read_only_output_dir(tmp_path, capsys, reference):
    hf, data, _ = reference
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                             capture_output=True).returncode == 0
    if not mounted and os.geteuid() != 0:
        ro.chmod(0o555)  # an unprivileged user cannot write there
    elif not mounted:
        # root, but no permission to mount: any read-only file system already mounted will do
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if "ro" in line.split()[3].split(",")]
        found = [Path(m) for m in mounts if Path(m).is_dir() and not (Path(m) / "run").exists()]
        assert found, "no way to get a read-only folder here: not mountable, running as root, none mounted"
        ro = found[0]
    try:
        refused(*train(capsys, hf, data, ro / "run"), "job.output_dir", str(ro))
        assert not (ro / "run").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)


def test_9_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, capsys, reference, monkeypatch):
    from tests.fixtures.faults.inject import disk_full_after

    hf, data, want = reference
    out = tmp_path / "run"
    with disk_full_after(monkeypatch, out / "checkpoints", saves_allowed=1):
        code, err = train(capsys, hf, data, out)
    refused(code, err, "no space left on the device", "step-4", "step-2")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]  # no .tmp left
    assert training_state.verify(out / "checkpoints" / "step-2") == []
    assert train(capsys, hf, data, out)[0] == 0
    assert losses(out) == want


def test_storage_errors_name_the_cause():
    from titanite.core.files import storage_error

    e = storage_error(OSError(errno.ENOSPC, "No space left on device", "/x/y"), "saving step-4")
    assert str(e) == "no space left on the device (/x/y) while saving step-4"

"""One run per output folder: an exclusive `flock` on `<output_dir>/.titanite.lock`.

Two runs writing one folder interleave metrics.jsonl and overwrite each other's checkpoints.
Rank 0 of a run takes the lock before it writes anything and holds it until the process ends;
a second run finds it taken and stops at once (exit 2), naming the holder's pid and host.
The other ranks of the holder's own torchrun job (the same TORCHELASTIC_RUN_ID, recorded in the
lock) may find it taken in their preflight, which runs beside rank 0's: that is not a second run.
The kernel drops an flock when its holder dies, however it dies, so a lock left by a killed
run never blocks the next one. The lock file is unlinked by its holder before release, and a
process that locked a file which was meanwhile unlinked tries again, so two runs can never
both believe they hold it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from titanite.core.errors import UserError

LOCK_NAME = ".titanite.lock"
_UNKNOWN = "holder unknown"


def check_free(output_dir: str | Path) -> None:
    """Refuse at once (UserError) when a live run holds `output_dir`, writing nothing: the
    cheap first check of preflight. `RunLock.acquire` is the one that counts."""
    path = Path(output_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file (or an unreadable one: acquire() will say)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        job = _job_id()
        if job is None or _read_info(fd).get("job") != job:
            raise _in_use(output_dir, _read_holder(fd)) from None
        # this job's rank 0 took the lock while this rank was still in preflight
    finally:
        os.close(fd)


def _job_id() -> str | None:
    """The torchrun job this process belongs to (every rank of one launch shares it)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


def _in_use(folder: str | Path, holder: str) -> UserError:
    return UserError(f"job.output_dir {folder} is in use by another titanite run ({holder}); wait for it "
                     "to finish, stop it, or choose another job.output_dir")


class RunLock:
    """Held from `acquire()` until `release()` (or the process's end)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.folder = Path(output_dir)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None
        self.created_folder = False

    def acquire(self) -> RunLock:
        self.created_folder = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        tries = 0
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                tries += 1
                if tries < 10 and holder == _UNKNOWN:  # another process's check_free, for a moment
                    time.sleep(0.1)
                    continue
                raise _in_use(self.folder, holder) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder unlinked it while we waited: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S"), "job": _job_id()}).encode())
        self._fd = fd
        return self

    def release(self, remove_folder_if_empty: bool = False) -> None:
        """Unlink and unlock. With `remove_folder_if_empty`, a folder this lock created and
        nothing else wrote into is removed too (a run that stopped before writing anything)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None
        if remove_folder_if_empty and self.created_folder:
            try:
                self.folder.rmdir()
            except OSError:
                pass  # not empty: the run wrote something, which stays


def _read_info(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _read_holder(fd: int) -> str:
    info = _read_info(fd)
    try:
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except KeyError:
        return _UNKNOWN

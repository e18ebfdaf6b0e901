"""Fault injection for the reliability tests and the fault matrix (tests/faults/matrix.py).

- `disk_full_after`: the disk fills up during a checkpoint save. The writes DCP makes for the
  save after `saves_allowed` complete ones get half their bytes onto disk, then ENOSPC, as a
  real full disk behaves.
- `CrashPoints`: SIGKILL the process at the K-th file-system operation of the save of a given
  step (a file opened for writing, a write, fsync, rename, delete), so a kill can be placed at
  any point of a save: in the middle of a shard, between the shards and the manifest, between
  the rename and the pruning of old checkpoints. An asynchronous save's operations count
  wherever they run: in the step, or in the background threads that write and finalise it
  while the next steps train.

Both hook `Saver.save` (titanite/checkpoint/saving.py), which every save of a run goes through.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import shutil
import signal
import threading
from pathlib import Path

from torch.distributed.checkpoint import filesystem

from titanite.checkpoint import saving


class _FullDiskStream:
    def __init__(self, stream, path):
        self._stream, self._path = stream, path

    def write(self, data):
        half = memoryview(data)[: max(1, len(data) // 2)]
        self._stream.write(half)
        self._stream.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._path))

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stream.close()


@contextlib.contextmanager
def disk_full_after(monkeypatch, root: Path, saves_allowed: int):
    """Within the block, checkpoint saves under `root` after the first `saves_allowed` hit a full
    disk. A write belongs to the save whose `.tmp-step-N` folder it goes to, so an asynchronous
    save's background writes are caught as well as a synchronous save's."""
    started: list[int] = []  # the steps saved, in order
    real_save, real_stream = saving.Saver.save, filesystem.FileSystem.create_stream

    def noting_save(self, ckpt_root, step, *a, **kw):
        started.append(step)
        return real_save(self, ckpt_root, step, *a, **kw)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real_stream(self, path, mode) as stream:
            folders = [p.name for p in Path(path).parents if Path(root) in p.parents]
            steps = [int(f.removeprefix(".tmp-step-")) for f in folders if f.startswith(".tmp-step-")]
            full = "w" in mode and bool(steps) and steps[0] not in started[:saves_allowed]
            yield _FullDiskStream(stream, path) if full else stream

    monkeypatch.setattr(saving.Saver, "save", noting_save)
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    try:
        yield
    finally:
        monkeypatch.setattr(saving.Saver, "save", real_save)
        monkeypatch.setattr(filesystem.FileSystem, "create_stream", real_stream)


class CrashPoints:
    """Count (kill_at=0) or kill at (kill_at=K) the file-system operations of the save of `step`.

    Installed process-wide by patching builtins.open (write modes), file writes, os.fsync,
    os.rename, os.replace and shutil.rmtree. An operation is the save's when it runs in the
    `Saver.save(step=...)` call itself, or in another thread until the next save begins (the
    background writer and finaliser of an asynchronous save; the next save first waits for
    them, so each operation is counted once, in a fixed order). `children_file`: where to write
    the pids of this process's children just before the kill, to check that none outlives it.
    """

    def __init__(self, step: int, kill_at: int, children_file: str = "") -> None:
        self.step, self.kill_at, self.children_file = step, kill_at, children_file
        self.saving: int | None = None  # the step of the latest save begun
        self.caller: int | None = None  # the thread inside Saver.save, while it is
        self.events: list[str] = []  # "kind name" of every operation seen, in order

    @property
    def active(self) -> bool:
        me = threading.get_ident()
        return self.saving == self.step and (me == self.caller or me != threading.main_thread().ident)

    def event(self, kind: str, target: object = "") -> None:
        if not self.active:
            return
        self.events.append(f"{kind} {Path(str(target)).name}")
        if len(self.events) == self.kill_at:
            if self.children_file:
                self._write_children()
            os.kill(os.getpid(), signal.SIGKILL)

    def _write_children(self) -> None:
        pids = [int(p) for task in Path("/proc/self/task").iterdir()
                for p in (task / "children").read_text().split()]
        fd = os.open(self.children_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # os.write: not counted
        os.write(fd, json.dumps(pids).encode())
        os.close(fd)

    def install(self) -> None:
        real_open, real_fsync, real_rename = builtins.open, os.fsync, os.rename
        real_replace, real_rmtree, real_save = os.replace, shutil.rmtree, saving.Saver.save
        points = self

        class Writer:
            def __init__(self, f, name):
                self._f, self._name = f, name

            def write(self, data):
                points.event("write", self._name)
                n = self._f.write(data)
                points.event("wrote", self._name)
                return n

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return self._f.__exit__(*exc)

            def __iter__(self):
                return iter(self._f)

        def open_(file, mode="r", *a, **kw):
            f = real_open(file, mode, *a, **kw)
            if points.active and any(c in mode for c in "wax+"):
                points.event("open", file)
                return Writer(f, file)
            return f

        def wrap(fn, kind):
            def inner(*a, **kw):
                points.event(kind, a[0] if a and not isinstance(a[0], int) else "")
                return fn(*a, **kw)
            return inner

        def save(saver, ckpt_root, step, *a, **kw):
            saver.wait()  # the save in flight finishes as the previous step's
            points.saving, points.caller = step, threading.get_ident()
            try:
                return real_save(saver, ckpt_root, step, *a, **kw)
            finally:
                points.caller = None

        builtins.open = io.open = open_  # pathlib opens through io.open
        os.fsync, os.rename = wrap(real_fsync, "fsync"), wrap(real_rename, "rename")
        os.replace, shutil.rmtree = wrap(real_replace, "replace"), wrap(real_rmtree, "rmtree")
        saving.Saver.save = save

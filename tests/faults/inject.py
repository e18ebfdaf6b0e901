"""Fault injection for the reliability tests and the fault matrix (tests/faults/matrix.py).

- `disk_full_after`: the disk fills up during a checkpoint save. The writes DCP makes for the
  save after `saves_allowed` complete ones get half their bytes onto disk, then ENOSPC, as a
  real full disk behaves.
- `CrashPoints`: SIGKILL the process at the K-th file-system operation of the save of a given
  step (a file opened for writing, a write, fsync, rename, delete), so a kill can be placed at
  any point of a save: in the middle of a shard, between the shards and the manifest, between
  the rename and the pruning of old checkpoints.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import shutil
import signal
from pathlib import Path

from torch.distributed.checkpoint import filesystem

from titanite.checkpoint import training_state


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
    """Within the block, checkpoint saves under `root` after the first `saves_allowed` hit a full disk."""
    done = {"saves": 0}
    real_save, real_stream = training_state.save, filesystem.FileSystem.create_stream

    def counting_save(*a, **kw):
        path = real_save(*a, **kw)
        done["saves"] += 1
        return path

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real_stream(self, path, mode) as stream:
            full = "w" in mode and Path(root) in Path(path).parents and done["saves"] >= saves_allowed
            yield _FullDiskStream(stream, path) if full else stream

    monkeypatch.setattr(training_state, "save", counting_save)
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    try:
        yield
    finally:
        monkeypatch.setattr(training_state, "save", real_save)
        monkeypatch.setattr(filesystem.FileSystem, "create_stream", real_stream)


class CrashPoints:
    """Count (kill_at=0) or kill at (kill_at=K) the file-system operations of the save of `step`.

    Installed process-wide by patching builtins.open (write modes), file writes, os.fsync,
    os.rename, os.replace and shutil.rmtree while `training_state.save(step=...)` runs.
    """

    def __init__(self, step: int, kill_at: int) -> None:
        self.step, self.kill_at, self.active = step, kill_at, False
        self.events: list[str] = []  # "kind name" of every operation seen, in order

    def event(self, kind: str, target: object = "") -> None:
        if not self.active:
            return
        self.events.append(f"{kind} {Path(str(target)).name}")
        if len(self.events) == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        real_open, real_fsync, real_rename = builtins.open, os.fsync, os.rename
        real_replace, real_rmtree, real_save = os.replace, shutil.rmtree, training_state.save
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

        def save(ckpt_root, step, *a, **kw):
            points.active = step == points.step
            try:
                return real_save(ckpt_root, step, *a, **kw)
            finally:
                points.active = False

        builtins.open = io.open = open_  # pathlib opens through io.open
        os.fsync, os.rename = wrap(real_fsync, "fsync"), wrap(real_rename, "rename")
        os.replace, shutil.rmtree = wrap(real_replace, "replace"), wrap(real_rmtree, "rmtree")
        training_state.save = save

"""Writing checkpoints: in the step (checkpoint.async_mode = "off") or in the background.

A save goes to `<output_dir>/checkpoints/.tmp-step-N`:
  1. rank 0 makes the folder (`begin_save`);
  2. DCP writes and fsyncs every rank's shards, then rank 0 the metadata;
  3. rank 0 writes trainer_state.json and config.toml;
  4. every rank hashes the files it wrote, reading them back; rank 0 writes the manifest from
     every rank's digests, so only once all the files are on disk;
  5. rank 0 renames the folder to `step-N`, and only then prunes older checkpoints.
Any failure on the way (a full disk, a read-only folder), on any rank, removes the temporary
folder and raises the same UserError on every rank; earlier checkpoints are never touched.

`Saver` runs saves in the run's mode. "off": all of it in the step (`save`). "async" and
"async_pinned": the step waits for 1 and for a copy of the state in host memory (`HostStager`,
pinned where the device has pinned memory); DCP's `async_save` writes from that copy in its own
thread, and 3-5 (`finish_save`) run in the saver's thread as soon as the write is done. They run
there, not at a later step, because hashing reads the whole checkpoint back: the most expensive
part after the write. A background save's collectives (DCP's plan, the digests, the outcome) go
over a gloo group of its own, so they never interleave with the step's on the default group;
rank 0 finalises only after every rank's write and hashes are in (both are collectives).
A run waits for a save in flight at the next save (one at a time, and its host buffers are
reused), the final save and a SIGTERM's (the export and the exit come after), and the end of
the run. A save that failed in the background is seen at the next step boundary (`failed`,
agreed over the ranks by the trainer), which then stops with its UserError (exit 2), like a
synchronous storage error.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from titanite.checkpoint.training_state import STATE_FILE, latest_checkpoint, list_checkpoints, state_to_save
from titanite.core.errors import UserError
from titanite.core.files import file_digest, fsync_folder, storage_error
from titanite.device.choice import synchronize
from titanite.device.memory import has_pinned_memory
from titanite.formats import dcp_safe, manifest
from titanite.parallel.distributed import gather_texts, global_rank, global_world_size

log = logging.getLogger("titanite")

_WRITER = re.compile(r"__(\d+)_")  # DCP names each rank's shard files __<rank>_<n>.distcp
_SINGLE_PROCESS = "torch.distributed is disabled"  # DCP's warning that one process is assumed: intended


# -- a save's parts (all of them in the step when async_mode is "off") ---------------------------


def save(ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         trainer_state: dict[str, Any], config_toml: str, keep_latest: int) -> Path:
    """Save everything needed to resume at `step`; then prune to `keep_latest` (0 keeps all).
    A file-system fault raises UserError after removing the partial save. (`Saver` runs the
    same parts with the write and `finish_save` in the background.)"""
    tmp = begin_save(ckpt_root, step)
    state = state_to_save(model, optimizer)

    def write() -> Metadata:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
            return dcp.save(state, storage_writer=shard_writer(tmp), no_dist=not dist.is_initialized())

    return finish_save(ckpt_root, step, write, state_record(step, trainer_state), config_toml, keep_latest)


def begin_save(ckpt_root: Path, step: int) -> Path:
    """The save's temporary folder, made empty by rank 0 (a stale one is removed) before any rank
    goes on."""
    tmp = ckpt_root / f".tmp-step-{step}"
    error = None
    if global_rank() == 0:
        try:
            ckpt_root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            error = e
    failures = [t for t in gather_texts(_describe(error, ckpt_root, step)) if t]
    if failures:
        _give_up(ckpt_root, step, failures[0], error)
    return tmp


def shard_writer(tmp: Path) -> FileSystemWriter:
    """DCP's writer for the shards and metadata: every file fsynced before the write returns."""
    return FileSystemWriter(str(tmp), sync_files=True)


def state_record(step: int, trainer_state: dict[str, Any]) -> str:
    """trainer_state.json's text (taken when the save starts: the loader moves on)."""
    return json.dumps({"step": step, **trainer_state}, indent=2)


def finish_save(ckpt_root: Path, step: int, write: Callable[[], Metadata], record: str, config_toml: str,
                keep_latest: int, group: dist.ProcessGroup | None = None) -> Path:
    """A save from its write on, on every rank of `group` (the default group when None):
    `write()` has DCP write and fsync every rank's shards, and rank 0 the metadata once all
    ranks wrote theirs; rank 0 writes the trainer state (`record`) and config; every rank hashes
    the files it wrote, reading them back; rank 0 writes the manifest from every rank's digests,
    so only after all the files are on disk, renames the folder into place, then prunes. Every
    rank ends the same way: with the path, or with the same error after the partial save is
    removed (a failure on one rank is shared, so no rank waits for a peer that gave up)."""
    tmp, error, digests = ckpt_root / f".tmp-step-{step}", None, {}
    try:
        metadata = write()
        files: list[str] = []
        if global_rank() == 0:
            (tmp / STATE_FILE).write_text(record)
            (tmp / "config.toml").write_text(config_toml)
            files = [dcp_safe.METADATA_NAME, STATE_FILE, "config.toml"]
        shards = sorted({info.relative_path for info in metadata.storage_data.values()})
        files += [f for f in shards if _writer_of(f) == global_rank()]
        digests = {f: file_digest(tmp / f) for f in files}
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        error = e
    reports = [json.loads(text) for text in gather_texts(json.dumps(
        {"digests": digests, "failure": _describe(error, ckpt_root, step)}), group)]
    failures = [r["failure"] for r in reports if r["failure"]]
    if not failures:
        try:
            if global_rank() == 0:
                manifest.write(tmp, {f: d for r in reports for f, d in r["digests"].items()}, step)
                fsync_folder(tmp)
                _swap_in(tmp, ckpt_root / f"step-{step}")
                _prune(ckpt_root, keep_latest)
        except Exception as e:  # noqa: BLE001 -- shared with every rank below, then raised
            error = e
        failures = [t for t in gather_texts(_describe(error, ckpt_root, step), group) if t]
    if failures:
        _give_up(ckpt_root, step, failures[0], error)
    return ckpt_root / f"step-{step}"


def _describe(error: BaseException | None, ckpt_root: Path, step: int) -> str:
    """One line for this rank's failure in a save ("" for none): a storage fault as
    storage_error words it, anything else with the rank and the exception."""
    if error is None:
        return ""
    fault = _storage_fault(error)
    if fault is not None:
        return str(storage_error(fault, f"saving checkpoint step-{step} to {ckpt_root}"))
    first = f"{type(error).__name__}: {error}".splitlines()[0]
    return f"{first} on rank {global_rank()} while saving checkpoint step-{step} to {ckpt_root}"


def _give_up(ckpt_root: Path, step: int, failure: str, error: BaseException | None) -> NoReturn:
    """Remove the partial save (rank 0) and raise: this rank's own exception when it was not a
    storage fault (a bug keeps its traceback), else UserError(failure), naming what is kept."""
    if global_rank() == 0:
        shutil.rmtree(ckpt_root / f".tmp-step-{step}", ignore_errors=True)
    if error is not None and _storage_fault(error) is None:
        raise error
    previous = latest_checkpoint(ckpt_root)
    raise UserError(f"{failure}; the partial save was removed and the last complete checkpoint is "
                    f"{previous or 'none'}")


def _writer_of(relative_path: str) -> int:
    """The rank that wrote a DCP shard file (rank 0 for names without the rank prefix)."""
    m = _WRITER.match(relative_path)
    return int(m.group(1)) if m and int(m.group(1)) < global_world_size() else 0


def _storage_fault(e: BaseException) -> OSError | None:
    """The OSError behind a save failure (DCP wraps each rank's exception), or None."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, CheckpointException):
        for exc, _trace in e.failures.values():
            if isinstance(exc, OSError):
                return exc
    return None


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. A checkpoint already there (a re-save of the same step) is moved
    aside first and deleted last, so a kill in between leaves one of the two complete."""
    aside = final.parent / f".old-{final.name}"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_folder(final.parent, files=False)
    shutil.rmtree(aside, ignore_errors=True)


def _prune(ckpt_root: Path, keep_latest: int) -> None:
    """Delete all but the newest `keep_latest` complete checkpoints (the one just written is the
    newest, so the newest verified checkpoint is never deleted)."""
    if keep_latest <= 0:
        return
    for _, d in list_checkpoints(ckpt_root)[:-keep_latest]:
        # Renamed first, so a kill mid-delete leaves a folder the next start removes, never a
        # half-deleted step-N that looks like a checkpoint.
        doomed = d.parent / f".del-{d.name}"
        os.rename(d, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


# -- in the background -----------------------------------------------------------------------


class HostStager(AsyncStager):
    """dcp.async_save's stager: copies the state into host buffers allocated at the first save
    and reused by every later one (so one host copy of this rank's state lives for the run),
    pinned when `pinned`; `stage` returns once the copy is complete. DCP's own DefaultStager
    pins only through CUDA (cudaHostRegister); torch's pinned allocator serves any accelerator
    that has one, which is what titanite.device.memory.has_pinned_memory probes."""

    _synchronize_after_execute = False  # stage() itself waits for the copies

    def __init__(self, device: torch.device, pinned: bool) -> None:
        self.device, self.pinned = device, pinned
        self._buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = {section: {name: self._copy(f"{section}/{name}", t) for name, t in tensors.items()}
                  for section, tensors in state_dict.items()}
        if self.pinned:  # the copies were only queued
            synchronize(self.device)
        return staged

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        buf = self._buffers.get(key)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = self._buffers[key] = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.pinned)
            assert buf.is_pinned() == self.pinned, "has_pinned_memory said the device pins host memory"
        buf.copy_(local, non_blocking=self.pinned)
        # A DTensor keeps its global layout around the host copy (DCP's metadata is made of it);
        # DTensor.from_local would move the copy back to the mesh's device.
        return DTensor(buf, t._spec, requires_grad=False) if isinstance(t, DTensor) else buf

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returns a complete copy."""

    def close(self) -> None:
        self._buffers.clear()


class Saver:
    """The run's checkpoint saves, in checkpoint.async_mode's way (see the module docstring).
    "async_pinned" on a device without pinned host memory is "async", with a warning."""

    def __init__(self, mode: str, device: torch.device, timeout_s: float) -> None:
        if mode == "async_pinned" and not has_pinned_memory(device.type):
            log.warning("checkpoint.async_mode = 'async_pinned': %s has no pinned host memory, so checkpoints are "
                        "staged in pageable host memory ('async')", device.type)
            mode = "async"
        self.mode = mode
        self._pending: Future[Path] | None = None
        self._stager: HostStager | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._group: dist.ProcessGroup | None = None
        if mode != "off":
            self._stager = HostStager(device, pinned=mode == "async_pinned")
            if global_rank() == 0:
                log.info("checkpoints: staged in %s host memory, then written in the background",
                         "pinned" if self._stager.pinned else "pageable")
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titanite-checkpoint")
            # A filter for the process, not catch_warnings: DCP warns from its writer thread.
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
            if dist.is_initialized():  # a collective: every rank makes it at the same point of start-up
                self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def save(self, ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any], config_toml: str, keep_latest: int) -> None:
        """Save at `step` (every rank calls it), after the save in flight, if any, is complete.
        "off": returns with the checkpoint in place. Else returns once the state is staged in
        host memory, and the checkpoint lands in the background (`wait`, `failed`)."""
        self.wait()
        start = time.perf_counter()
        if self.mode == "off":
            path = save(ckpt_root, step, model, optimizer, trainer_state, config_toml, keep_latest)
            if global_rank() == 0:
                log.info("saved checkpoint %s (%.2f s)", path, time.perf_counter() - start)
            return
        assert self._stager is not None and self._thread is not None, "save after close"
        tmp = begin_save(ckpt_root, step)
        written = dcp.async_save(state_to_save(model, optimizer), storage_writer=shard_writer(tmp),
                                 process_group=self._group, async_stager=self._stager, no_dist=self._group is None)
        blocked = time.perf_counter() - start
        self._pending = self._thread.submit(self._finish, ckpt_root, step, written, state_record(step, trainer_state),
                                            config_toml, keep_latest, start, blocked)

    def _finish(self, ckpt_root: Path, step: int, written: Future, record: str, config_toml: str,
                keep_latest: int, start: float, blocked: float) -> Path:
        path = finish_save(ckpt_root, step, written.result, record, config_toml, keep_latest, self._group)
        if global_rank() == 0:
            log.info("saved checkpoint %s (the step waited %.2f s; written in the background, done %.2f s after "
                     "the save began)", path, blocked, time.perf_counter() - start)
        return path

    def in_flight(self) -> bool:
        """Whether a save is still being written in the background."""
        return self._pending is not None and not self._pending.done()

    def failed(self) -> bool:
        """Whether the save in flight has ended with an error, which `wait` raises. Never blocks."""
        return self._pending is not None and self._pending.done() and self._pending.exception() is not None

    def wait(self) -> None:
        """Return once no save is in flight; raise the error a background save ended with."""
        if self._pending is None:
            return
        error = self._pending.exception()  # blocks; a signal handler's exception leaves it pending
        self._pending = None
        if error is not None:
            raise error

    def close(self) -> None:
        """End the background work with the run, however the run ends: wait for a save in
        flight, then stop the thread and free the host copy. Where the run ends normally the
        final save was already waited for (and its error raised); here the run may be ending
        on an error of its own, which this save's error must not replace, so it is logged."""
        try:
            self.wait()
        except UserError as e:
            log.error("%s", e)
        except Exception:  # noqa: BLE001 -- reported with its traceback; the run's own error goes on
            log.exception("the checkpoint save in the background failed")
        finally:
            if self._thread is not None:
                self._thread.shutdown()
                self._thread = None
            if self._stager is not None:
                self._stager.close()

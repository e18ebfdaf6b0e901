"""File-system rules every reader and writer of titanite follows.

- A file named *by another file* (a safetensors index, a checkpoint manifest or DCP metadata,
  a tokenizer folder's side files) must resolve inside the folder that names it, after
  following symlinks. A crafted `weight_map` entry such as `../../etc/passwd` or `/etc/shadow`
  is refused instead of opened. The one exception is the Hugging Face hub cache, whose
  `snapshots/<revision>/` files are symlinks into the same repository's `blobs/` folder.
- An input path the user names must be a regular file or a folder: a FIFO, socket or device
  would block a reader forever or return endless bytes.
- File-system faults (a full disk, a read-only folder) are the user's to fix: they become one
  `UserError` naming the path and the cause, never a traceback.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from titanite.core.errors import UserError

# errno values that mean "the storage refuses", not "titanite has a bug".
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                  errno.EIO, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG}


def is_within(path: Path, root: Path) -> bool:
    """Whether `path` is `root` or lies below it (compare resolved paths)."""
    return path == root or root in path.parents


def inside_folder(folder: str | Path, name: str, what: str) -> Path:
    """`folder / name`, refused (UserError naming `what`) unless `name` is a relative path that,
    with symlinks followed, stays inside `folder` (or, for a hub-cache snapshot, its `blobs/`)."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UserError(f"{what}: file name {name!r} is not a valid relative path")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise UserError(f"{what}: file name {name!r} points outside {folder}; only files inside the "
                        "folder are read")
    root = folder.resolve()
    target = (folder / rel).resolve()
    if is_within(target, root):
        return folder / rel
    # Hub cache layout: <repo>/snapshots/<revision>/<file> -> <repo>/blobs/<hash>.
    if root.parent.name == "snapshots" and is_within(target, root.parent.parent / "blobs"):
        return folder / rel
    raise UserError(f"{what}: {folder / rel} is a link to {target}, outside {folder}; only files "
                    "inside the folder are read")


def require_regular(path: str | Path, key: str, folder_ok: bool = True) -> Path:
    """`path` exists and is a regular file (or, with folder_ok, a folder); else a UserError
    naming `key`. A FIFO, socket or device node is refused: reading one blocks or never ends."""
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise UserError(f"{key}: {p} does not exist") from None
    except OSError as e:
        raise UserError(f"{key}: cannot read {p}: {e.strerror}") from None
    if stat.S_ISREG(mode) or (folder_ok and stat.S_ISDIR(mode)):
        return p
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a folder" if stat.S_ISDIR(mode)
            else "not a regular file")
    want = "a regular file or a folder" if folder_ok else "a regular file"
    raise UserError(f"{key}: {p} is {kind}; expected {want}")


def check_writable_folder(path: str | Path, key: str) -> None:
    """`path` can become (or already is) a folder this process may write, checked without
    writing anything: an existing file there, or a read-only / unwritable ancestor, is refused."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"{key}: {p} exists and is not a folder")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{key}: {existing} (on the way to {p}) is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "is on a read-only file system" if _read_only_fs(existing) else "is not writable by this user"
        raise UserError(f"{key}: {existing} {reason}" + (f", so {p} cannot be created" if existing != p else ""))


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def storage_error(e: OSError, doing: str) -> UserError:
    """A UserError for a file-system fault met while `doing` something (e.g. 'saving checkpoint
    step-4 to outputs/run/checkpoints')."""
    cause = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
             errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
             errno.EPERM: "operation not permitted"}.get(e.errno, e.strerror or str(e))
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return UserError(f"{cause}{where} while {doing}")


def fsync_folder(folder: Path, files: bool = True) -> None:
    """Flush `folder`'s files (unless files=False), then its entry list, to disk: a folder
    renamed into place, or a rename inside it, must survive a power loss complete."""
    contents = [f for f in folder.iterdir() if f.is_file()] if files else []
    for path in [*contents, folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def file_digest(path: Path) -> dict[str, Any]:
    """{"size": bytes, "sha256": hex} of one file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}

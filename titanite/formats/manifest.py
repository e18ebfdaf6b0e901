"""Checkpoint manifests: the size and SHA-256 of every file of a checkpoint, written last.

DCP records no checksums: flipped bytes in a `.distcp` file load as other numbers, silently.
So every titanite checkpoint ends with `manifest.json`, computed by reading the files back after
they were written and fsynced. A checkpoint folder without a complete manifest is not a
checkpoint. Verifying one means: the manifest parses, names only files inside the folder,
covers every file the DCP metadata points into, and each file has its recorded size and hash.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from titanite.core.errors import UserError
from titanite.core.files import file_digest, inside_folder

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


def write(folder: Path, files: dict[str, dict[str, Any]], step: int) -> None:
    """Write `folder/manifest.json` for `files` ({name: digest}) and fsync it."""
    body = {"format_version": FORMAT_VERSION, "step": step,
            "files": {name: files[name] for name in sorted(files)}}
    path = folder / MANIFEST_NAME
    with open(path, "w") as f:
        f.write(json.dumps(body, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read(folder: Path) -> dict[str, dict[str, Any]]:
    """The manifest's {name: {"size", "sha256"}}; UserError when it is missing or malformed."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise UserError(f"{folder} has no {MANIFEST_NAME}: the save did not finish (or an older "
                        "titanite wrote it), so it is not a complete checkpoint")
    try:
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is corrupt: {e}") from None
    files = body.get("files") if isinstance(body, dict) else None
    if body.get("format_version") != FORMAT_VERSION or not isinstance(files, dict) or not files:
        raise UserError(f"{path} is not a titanite checkpoint manifest (format_version "
                        f"{FORMAT_VERSION} with a 'files' table)")
    for name, entry in files.items():
        inside_folder(folder, name, f"manifest {path}")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str)):
            raise UserError(f"{path}: bad entry for {name!r}")
    return files


def check_sizes(folder: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Problems found from sizes alone (cheap: no data read): missing or resized files."""
    problems = []
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, the manifest says {entry['size']}")
    return problems


def check_hashes(folder: Path, files: dict[str, dict[str, Any]], names: Iterable[str]) -> list[str]:
    """Problems among `names`: a file whose SHA-256 differs from the manifest's."""
    problems = []
    for name in names:
        path = folder / name
        if not path.is_file():
            continue  # reported by check_sizes
        if file_digest(path)["sha256"] != files[name]["sha256"]:
            problems.append(f"{name} does not match its SHA-256 in the manifest (corrupt bytes)")
    return problems

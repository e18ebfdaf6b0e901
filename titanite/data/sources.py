"""Document sources: turn `[data]` into a stream of document strings.

Reads .txt files (one document per file), JSON lines, parquet, `datasets` folders written by
`save_to_disk`, a hub dataset (`data.dataset_name`, the only source that touches the network),
and "<stdlib>": this Python's standard-library sources, a corpus every machine has.
Folders are read in sorted order so that every rank and every rerun sees the same stream.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanite.core.config import DataConfig
from titanite.core.errors import UserError

STDLIB = "<stdlib>"

# Folder patterns used when data.glob is empty, by data.format.
DEFAULT_GLOBS = {
    "text": ("**/*.txt",),
    "jsonl": ("**/*.jsonl",),
    "parquet": ("**/*.parquet",),
    "auto": ("**/*.txt", "**/*.jsonl", "**/*.parquet"),
}
_SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
_ROW_BATCH = 1024  # rows per read from parquet / arrow: bounds memory, not results


@dataclass
class SourceStats:
    """What the source stream read and skipped; filled in while iterating."""

    files: int = 0
    documents: int = 0
    empty_skipped: int = 0
    undecodable_skipped: int = 0

    def summary(self) -> str:
        return (f"{self.files} files, {self.documents} documents "
                f"(skipped: {self.empty_skipped} empty, {self.undecodable_skipped} undecodable files)")


def describe_source(cfg: DataConfig) -> str:
    """The data source as the user named it, for messages."""
    if cfg.dataset_name:
        return f"data.dataset_name = {cfg.dataset_name!r}"
    return f"data.path = {cfg.path!r}"


def iter_documents(cfg: DataConfig, stats: SourceStats | None = None) -> Iterator[str]:
    """Yield every non-empty document of the configured source, in a deterministic order.

    Whitespace-only documents (and null fields) are skipped and counted in `stats`.
    Raises UserError naming the key, file (and line) for anything the user must fix.
    """
    stats = stats if stats is not None else SourceStats()
    if cfg.dataset_name and cfg.path:
        raise UserError(f"set only one of data.path ({cfg.path!r}) and data.dataset_name "
                        f"({cfg.dataset_name!r})")
    raw = _hub_rows(cfg) if cfg.dataset_name else _path_documents(cfg, stats)
    for text in raw:
        if text is None or not text.strip():
            stats.empty_skipped += 1
            continue
        stats.documents += 1
        yield text


def _path_documents(cfg: DataConfig, stats: SourceStats) -> Iterator[str | None]:
    if not cfg.path:
        raise UserError("no data: set data.path (a file, a folder, or '<stdlib>') or data.dataset_name")
    if cfg.path == STDLIB:
        fmt = "text" if cfg.format == "auto" else cfg.format
        yield from _read_files(_stdlib_files(cfg), fmt, cfg, stats)
        return
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise UserError(f"data.path: {path} does not exist")
    if path.is_dir() and cfg.format in ("auto", "dataset") and _is_saved_dataset(path):
        yield from _saved_dataset_rows(path, cfg)
        return
    if cfg.format == "dataset":
        raise UserError(f"data.path: {path} is not a datasets save_to_disk folder (data.format = "
                        "'dataset' needs dataset_info.json + state.json, or dataset_dict.json)")
    yield from _read_files(path_files(path, cfg, DEFAULT_GLOBS[cfg.format]), cfg.format, cfg, stats)


def _stdlib_files(cfg: DataConfig) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # The stdlib folder can hold site-packages: installed third-party code, not the stdlib.
    files = [f for f in _list_files(root, (cfg.glob or "**/*.py",), cfg)
             if not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts)]
    return files[: cfg.max_files or None]


def path_files(path: Path, cfg: DataConfig, default_globs: tuple[str, ...]) -> list[Path]:
    """The files of data.path that are read: the file itself, or a folder's files matching
    data.glob (else `default_globs`), sorted, at most data.max_files."""
    if not path.is_dir():
        return [path]
    return _list_files(path, (cfg.glob,) if cfg.glob else default_globs, cfg)[: cfg.max_files or None]


def input_files(cfg: DataConfig, default_globs: tuple[str, ...] | None = None) -> list[Path]:
    """Every local file the configured source reads, in reading order: what a token store of it
    is keyed on. A datasets folder counts whole; a hub dataset (data.dataset_name) has none."""
    if cfg.dataset_name:
        return []
    if cfg.path == STDLIB:
        return _stdlib_files(cfg)
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise UserError(f"data.path: {path} does not exist")
    if path.is_dir() and cfg.format in ("auto", "dataset", "chat") and _is_saved_dataset(path):
        return sorted(p for p in path.rglob("*") if p.is_file())
    return path_files(path, cfg, default_globs or DEFAULT_GLOBS.get(cfg.format, DEFAULT_GLOBS["auto"]))


def _list_files(root: Path, globs: Iterable[str], cfg: DataConfig) -> list[Path]:
    """Files under `root` matching any glob, sorted by relative path (stable across machines)."""
    found = {p for g in globs for p in root.glob(g) if p.is_file()}
    if not found:
        raise UserError(f"data.path: folder {root} has no files matching {' or '.join(globs)} "
                        f"(data.glob = {cfg.glob!r}, data.format = {cfg.format!r})")
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_files(files: list[Path], fmt: str, cfg: DataConfig, stats: SourceStats) -> Iterator[str | None]:
    for f in files:
        file_fmt = _SUFFIX_FORMATS.get(f.suffix.lower(), "text") if fmt == "auto" else fmt
        if file_fmt == "parquet":
            stats.files += 1
            yield from _parquet_rows(f, cfg.text_field)
            continue
        text = _decode(f, cfg.on_decode_error)
        if text is None:
            stats.undecodable_skipped += 1
            continue
        stats.files += 1
        if file_fmt == "jsonl":
            yield from _jsonl_rows(f, text, cfg.text_field)
        else:
            yield text


def _decode(f: Path, policy: str) -> str | None:
    """The file as UTF-8 text; None when it is not UTF-8 and policy is 'skip'."""
    data = f.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if policy == "error":
            raise UserError(f"{f}: not valid UTF-8 at byte offset {e.start} ({e.reason}); set "
                            "data.on_decode_error to 'skip' or 'replace' to read past it") from None
        if policy == "skip":
            return None
        assert policy == "replace", policy
        text = data.decode("utf-8", errors="replace")
    return text.removeprefix("\ufeff")  # a BOM is an encoding mark, not text


def json_lines(f: Path, text: str) -> Iterator[tuple[str, Any]]:
    """('file:line', the parsed value) per non-blank line, or ('file:line', JSONDecodeError)."""
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028, which splitlines breaks on.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield f"{f}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{f}:{lineno}", e


def _jsonl_rows(f: Path, text: str, field: str) -> Iterator[str | None]:
    for where, row in json_lines(f, text):
        if isinstance(row, json.JSONDecodeError):
            raise UserError(f"{where}: not valid JSON ({row.msg} at column {row.colno})")
        if not isinstance(row, dict) or field not in row:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise UserError(f"{where}: no field {field!r} (data.text_field); the line has {keys}")
        yield _check_text(row[field], where, field)


def read_parquet(f: Path, field: str | None = None, key: str = "") -> Iterator[tuple[str, Any]]:
    """('file row N', value) per row, in batches: the value of column `field` (named by config key
    `key` in errors), or with field None the whole row as a dict."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{f}: cannot read as parquet: {e}") from e
    columns = pf.schema_arrow.names
    if field is not None and field not in columns:
        raise UserError(f"{f}: no column {field!r} ({key}); columns: {columns}")
    row = 0
    for batch in pf.iter_batches(columns=None if field is None else [field], batch_size=_ROW_BATCH):
        for value in batch.to_pylist() if field is None else batch.column(0).to_pylist():
            yield f"{f} row {row}", value
            row += 1


def _parquet_rows(f: Path, field: str) -> Iterator[str | None]:
    for where, value in read_parquet(f, field, "data.text_field"):
        yield _check_text(value, where, field)


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "dataset_info.json").is_file() and (path / "state.json").is_file())


def load_saved_dataset(path: Path, split: str) -> Any:
    """A `datasets` save_to_disk folder; for a DatasetDict, its `split` (data.split)."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"data.split = {split!r} is not in {path}; splits: {list(ds)}")
        ds = ds[split]
    return ds


def dataset_column(ds: Any, where: str, field: str, key: str) -> Iterator[tuple[str, Any]]:
    """('<where> row N', value) of column `field` of a datasets Dataset, in batches."""
    if ds.column_names is not None and field not in ds.column_names:  # a stream may not know its columns
        raise UserError(f"{where}: no column {field!r} ({key}); columns: {ds.column_names}")
    row = 0
    for batch in ds.select_columns([field]).iter(batch_size=_ROW_BATCH):
        for value in batch[field]:
            yield f"{where} row {row}", value
            row += 1


def _saved_dataset_rows(path: Path, cfg: DataConfig) -> Iterator[str | None]:
    yield from _dataset_rows(load_saved_dataset(path, cfg.split), str(path), cfg.text_field)


def _hub_rows(cfg: DataConfig) -> Iterator[str | None]:
    import datasets

    try:
        ds = datasets.load_dataset(cfg.dataset_name, split=cfg.split, streaming=cfg.streaming)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as e:
        raise UserError(f"data.dataset_name = {cfg.dataset_name!r} (split {cfg.split!r}) "
                        f"could not be loaded: {e}") from e
    yield from _dataset_rows(ds, f"data.dataset_name = {cfg.dataset_name!r}", cfg.text_field)


def _dataset_rows(ds: Any, where: str, field: str) -> Iterator[str | None]:
    for row_where, value in dataset_column(ds, where, field, "data.text_field"):
        yield _check_text(value, row_where, field)


def _check_text(value: Any, where: str, field: str) -> str | None:
    """A document's text; None (null) counts as empty. Anything else is the user's mistake."""
    if value is None or isinstance(value, str):
        return value
    raise UserError(f"{where}: field {field!r} (data.text_field) holds {type(value).__name__}, "
                    "expected a string")

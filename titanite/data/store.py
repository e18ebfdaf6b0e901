"""The token store: a corpus tokenized once into memory-mapped arrays, read lazily by training.

A store is a folder:

- `tokens.bin`: int32 token ids of every sample, one after another (for text, each document
  followed by the separator `eos_id`; for chat, each rendered conversation);
- `labels.bin` (chat only): int32 labels aligned with the tokens (IGNORE_INDEX where a token
  carries no loss), as `tokenize_conversation` computes them;
- `offsets.bin`: int64 [samples + 1], where each sample starts in tokens.bin;
- `first_label.bin` (chat only): int32 [samples], the first position whose label is learned, so
  packing knows without reading labels whether a sample cut to seq_len still has loss;
- `manifest.json`, written last: the store format and version, what it was made from (each
  source file with size and mtime, a hash of the tokenizer files and chat template, the
  `[data]` settings that change tokens), the counts, the source statistics, and each array
  file's size and SHA-256.

The arrays are raw little-endian numpy buffers opened with `numpy.memmap`: opening a store
reads its manifest and maps the files, so start-up time and resident memory do not grow with
the corpus; each rank pages in only the windows it trains on.

A store is written into `<name>.tmp-<pid>/` and renamed into place after its manifest, so a
half-written store is never taken for a complete one; a later prepare removes the leftovers
of a killed one. `obtain` keeps prepared stores in a cache (`data.cache_dir`) keyed by a hash
of what the store is made from, under a file lock, so every rank of a run uses the one store
that the first rank to get there prepared.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, fields
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from titanite.config import DataConfig
from titanite.data.chat import ChatStats, apply_policy, chat_rows, finish_policy, load_chat_template, tokenize_row
from titanite.data.sources import SourceStats, describe_source, input_files, iter_documents
from titanite.data.tokenizer import Tokenizer, load_tokenizer
from titanite.errors import UserError
from titanite.kernels.reference_ops import IGNORE_INDEX

log = logging.getLogger("titanite")

FORMAT = "titanite-token-store"
VERSION = 1
MANIFEST = "manifest.json"
# The [data] keys that change what a store holds (seq_len, packing and shuffling do not: they
# are applied when a store is read).
_SETTINGS = ("path", "dataset_name", "split", "format", "glob", "max_files", "text_field", "on_decode_error",
             "messages_field", "chat_loss", "on_malformed")
_CHUNK_DOCS = 256  # documents per encode_batch call: enough to keep the Rust threads busy
_CHUNK_CHARS = 2_000_000  # ...or this many characters (about 1 s of work), whichever first
_CHUNK_ROWS = 64  # chat rows per worker task
_PROGRESS_EVERY_S = 5.0


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/titanite/tokens` (default ~/.cache/titanite/tokens)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "titanite" / "tokens"


def cache_dir(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def is_store(path: Path) -> bool:
    """Whether `path` is a token store folder (its manifest names the format)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get("format") == FORMAT
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


# -- what a store is made from -----------------------------------------------------------------

def _kind(cfg: DataConfig) -> str:
    return "chat" if cfg.format == "chat" else "text"


def _tokenizer_hash(cfg: DataConfig, tokenizer: Tokenizer) -> str:
    """SHA-256 over the tokenizer's files (tokenizer.json and its side files) and, for chat, the
    template file data.chat_template names."""
    h = hashlib.sha256()
    files = list(tokenizer.files)
    if _kind(cfg) == "chat" and cfg.chat_template:
        files.append(Path(cfg.chat_template).expanduser())
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def fingerprint(cfg: DataConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a store of this source and tokenizer is made from: the cache key is its hash."""
    from titanite.data.chat import CHAT_GLOBS

    files = input_files(cfg, CHAT_GLOBS if _kind(cfg) == "chat" else None)
    sources = []
    for f in files:
        st = f.stat()
        sources.append({"path": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    settings = {k: getattr(cfg, k) for k in _SETTINGS}
    if cfg.path and not cfg.dataset_name and cfg.path != "<stdlib>":
        settings["path"] = str(Path(cfg.path).expanduser().resolve())
    return {"format": FORMAT, "version": VERSION, "kind": _kind(cfg), "eos_id": tokenizer.eos_id,
            "tokenizer": _tokenizer_hash(cfg, tokenizer), "settings": settings, "sources": sources}


def cache_key(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:24]


# -- reading ---------------------------------------------------------------------------------

@dataclass
class TokenStore:
    """An opened store: memory-mapped arrays plus its manifest."""

    path: Path
    manifest: dict[str, Any]
    tokens: np.ndarray  # int32 [T]
    offsets: np.ndarray  # int64 [D + 1]
    labels: np.ndarray | None  # int32 [T], chat
    first_label: np.ndarray | None  # int32 [D], chat

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def max_id(self) -> int:
        return int(self.manifest["max_id"])

    def source_stats(self) -> SourceStats | ChatStats:
        cls = ChatStats if self.kind == "chat" else SourceStats
        saved = self.manifest["stats"]
        return cls(**{f.name: saved[f.name] for f in fields(cls)})

    def sample_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def check_ids(self, ids: np.ndarray, where: str) -> None:
        """Every id read must lie in [0, max_id]: a damaged file is stopped here, not trained on
        (a cheap check of what is read; `titanite data verify` re-hashes everything)."""
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > self.max_id):
            bad = int(ids.max()) if int(ids.max()) > self.max_id else int(ids.min())
            raise UserError(f"token store {self.path}: {where} holds id {bad}, outside [0, {self.max_id}] that it was "
                            "prepared with (a damaged file); check it with titanite data verify and prepare it again")

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample i as (ids, labels) int32 [T]: for text, every next token is learned."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = np.asarray(self.tokens[a:b])
        self.check_ids(ids, f"sample {i}")
        if self.labels is not None:
            labels = np.asarray(self.labels[a:b])
            self.check_ids(labels[labels != IGNORE_INDEX], f"sample {i}'s labels")
            return ids, labels
        labels = np.empty_like(ids)
        labels[:-1], labels[-1] = ids[1:], IGNORE_INDEX
        return ids, labels

    def first_learned(self) -> np.ndarray:
        """int64 [D]: each sample's first position with a learned label (1 past the end if none)."""
        if self.first_label is not None:
            return np.asarray(self.first_label, dtype=np.int64)
        lengths = self.sample_lengths()  # text: position 0 predicts token 1, if there is one
        return np.where(lengths >= 2, 0, lengths).astype(np.int64)


_ARRAYS = {"tokens": np.int32, "offsets": np.int64, "labels": np.int32, "first_label": np.int32}


def open_store(path: Path) -> TokenStore:
    """Open a complete store. Raises UserError naming the file when the manifest is missing or
    of another version, or a file's size is not what the manifest says (a truncated or
    replaced file is never read as tokens)."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} is not a complete token store: no {MANIFEST} (a prepare that did not "
                        "finish); run titanite data prepare again") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{manifest_path}: not a token store manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        manifest = manifest if isinstance(manifest, dict) else {}
        raise UserError(f"{manifest_path}: a token store of format {manifest.get('format')!r} version "
                        f"{manifest.get('version')!r}; this titanite reads {FORMAT!r} version {VERSION}. "
                        "Prepare it again")
    missing = [k for k in ("kind", "files", "max_id", "stats", "sources", "tokenizer", "eos_id") if k not in manifest]
    if missing or "tokens.bin" not in manifest["files"] or "offsets.bin" not in manifest["files"]:
        raise UserError(f"{manifest_path}: an incomplete token store manifest (missing {missing or 'array files'}); "
                        "prepare the store again")
    arrays: dict[str, np.ndarray | None] = {}
    for name, dtype in _ARRAYS.items():
        entry = manifest["files"].get(f"{name}.bin")
        if entry is None:
            arrays[name] = None
            continue
        f = path / f"{name}.bin"
        size = f.stat().st_size if f.is_file() else -1
        if size != entry["size"]:
            raise UserError(f"token store file {f}: {size} bytes on disk, the manifest says {entry['size']} "
                            "(truncated or replaced); prepare the store again")
        count = size // np.dtype(dtype).itemsize
        arrays[name] = np.memmap(f, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)
    store = TokenStore(path, manifest, arrays["tokens"], arrays["offsets"], arrays["labels"],
                       arrays["first_label"])
    if (store.num_samples < 1 or int(store.offsets[0]) != 0 or int(store.offsets[-1]) != store.num_tokens
            or bool((np.diff(store.offsets) < 0).any())):
        raise UserError(f"token store {path} holds no samples or its offsets do not match its tokens; "
                        "prepare it again")
    return store


def verify_store(path: Path) -> None:
    """Re-hash every array file against the manifest (reads the whole store)."""
    store = open_store(path)
    for name, entry in store.manifest["files"].items():
        h = hashlib.sha256()
        with open(path / name, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
        if h.hexdigest() != entry["sha256"]:
            raise UserError(f"token store file {path / name}: its SHA-256 differs from the manifest "
                            "(corrupt); prepare the store again")


# -- writing ---------------------------------------------------------------------------------

class _ArrayFile:
    """An append-only raw array file, hashed as it is written."""

    def __init__(self, path: Path, dtype: type) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        self._f = open(path, "wb")
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values, dtype=self.dtype.newbyteorder("<")).tobytes()
        self._f.write(data)
        self._hash.update(data)
        self.size += len(data)

    def close(self) -> dict[str, Any]:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"size": self.size, "sha256": self._hash.hexdigest()}


class _Progress:
    """Documents and tokens per second: a bar on a terminal, a log line every few seconds otherwise."""

    def __init__(self, what: str) -> None:
        self.what, self.docs, self.tokens = what, 0, 0
        self.start = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=f"tokenizing {what}", unit=" docs", dynamic_ncols=True)

    def add(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        now = time.monotonic()
        if self.bar is not None:
            self.bar.update(docs)
            self.bar.set_postfix_str(f"{self.tokens / max(now - self.start, 1e-9):,.0f} tokens/s", refresh=False)
        elif now - self.last >= _PROGRESS_EVERY_S:
            self.last = now
            log.info("tokenizing %s: %d documents, %d tokens (%.0f docs/s, %.0f tokens/s)", self.what,
                     self.docs, self.tokens, self.docs / (now - self.start), self.tokens / (now - self.start))

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return time.monotonic() - self.start


def _chunks(items: Iterator[Any], max_items: int, size_of=None, max_size: int = 0) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    size = 0
    for item in items:
        chunk.append(item)
        size += size_of(item) if size_of else 0
        if len(chunk) >= max_items or (max_size and size >= max_size):
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# Worker state (one tokenizer, and for chat the template, per worker process).
_WORKER: dict[str, Any] = {}


def _worker_init(cfg: DataConfig, tokenizer: Tokenizer | str) -> None:
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    _WORKER.update(cfg=cfg, tokenizer=tok, template=load_chat_template(cfg, tok) if _kind(cfg) == "chat" else None)


def _encode_texts(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A chunk of documents as (their tokens, each followed by the separator, int32; lengths)."""
    tok: Tokenizer = _WORKER["tokenizer"]
    encoded = tok.encode_batch(docs)
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.empty(int(lengths.sum()), dtype=np.int32)
    tokens[np.cumsum(lengths) - 1] = tok.eos_id
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for start, ids in zip(starts.tolist(), encoded):
        tokens[start:start + len(ids)] = ids
    return tokens, lengths


def _encode_rows(rows: list[tuple[str, Any]]) -> list[Any]:
    return [tokenize_row(_WORKER["template"], _WORKER["cfg"], where, row) for where, row in rows]


@contextlib.contextmanager
def _mapper(cfg: DataConfig, tokenizer: Tokenizer, workers: int):
    """An ordered map over chunks: in this process, or in `workers` worker processes (results
    come back in input order, so every worker count writes the same store)."""
    if workers <= 1:
        _worker_init(cfg, tokenizer)
        try:
            yield map
        finally:
            _WORKER.clear()
        return
    # Workers fork from a server process started once with this module imported: each starts in
    # milliseconds, and none inherits the threads of this one (the tokenizer's, torch's).
    if _kind(cfg) == "chat":
        load_chat_template(cfg, tokenizer)  # a missing or broken template: its message, here
    context = get_context("forkserver")
    context.set_forkserver_preload([__name__])
    try:
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init,
                                 initargs=(cfg, str(tokenizer.path))) as pool:
            yield lambda fn, chunks: _ordered(pool, fn, chunks, ahead=2 * workers + 1)
    except BrokenProcessPool as e:
        raise UserError(f"a tokenizer worker process died ({e}); rerun with --workers 1 to see why, or with "
                        "fewer workers if memory is short") from None


def _ordered(pool: ProcessPoolExecutor, fn, chunks: Iterable[Any], ahead: int) -> Iterator[Any]:
    """fn over chunks in the pool, results in input order, at most `ahead` chunks in flight (so
    the source is read only as fast as it is tokenized; Executor.map would read all of it first)."""
    pending: collections.deque = collections.deque()
    for chunk in chunks:
        pending.append(pool.submit(fn, chunk))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def prepare(cfg: DataConfig, tokenizer: Tokenizer, folder: Path, workers: int = 1,
            fp: dict[str, Any] | None = None) -> TokenStore:
    """Tokenize the configured source into a store at `folder` (replacing any there).

    Reads the source in order in this process; tokenization (and chat rendering) runs in
    `workers` processes. Raises UserError for anything in the data the user must fix, leaving
    no folder behind.
    """
    fp = fp or fingerprint(cfg, tokenizer)
    check_destination(folder, cfg, fp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f"{folder.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a prepare that was killed
    tmp = folder.parent / f"{folder.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        manifest = _write(cfg, tokenizer, tmp, workers, fp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return open_store(folder)


def check_destination(folder: Path, cfg: DataConfig, fp: dict[str, Any]) -> None:
    """A store may replace only an empty folder or another store, and may not lie inside the
    data it is made from or hold any of it (UserError; nothing is touched)."""
    target = folder.resolve()
    roots = [Path(src["path"]) for src in fp["sources"]]
    if cfg.path and Path(cfg.path).expanduser().is_dir():
        roots.append(Path(cfg.path).expanduser().resolve())
    for root in roots:
        if root == target or target in root.parents or root in target.parents:
            raise UserError(f"{folder} holds or lies inside the data it would be made from ({root}); write the "
                            "store somewhere else")
    if folder.exists() and not (folder.is_dir() and (is_store(folder) or not any(folder.iterdir()))):
        raise UserError(f"{folder} exists and is not a token store; a store is written only to a new or empty "
                        "folder, or over another store: choose another --out")


@contextlib.contextmanager
def locked_destination(folder: Path) -> Iterator[None]:
    """One prepare at a time into `folder` (a lock file beside it, `.<name>.lock`)."""
    with _locked(folder.parent / f".{folder.name}.lock"):
        yield


def _write(cfg: DataConfig, tokenizer: Tokenizer, tmp: Path, workers: int, fp: dict[str, Any]) -> dict[str, Any]:
    chat = fp["kind"] == "chat"
    tokens = _ArrayFile(tmp / "tokens.bin", np.int32)
    labels = _ArrayFile(tmp / "labels.bin", np.int32) if chat else None
    lengths: list[np.ndarray] = []
    first: list[int] = []
    max_id = -1
    progress = _Progress(describe_source(cfg))
    stats: SourceStats | ChatStats
    with _mapper(cfg, tokenizer, workers) as mapper:
        if chat:
            stats = ChatStats()
            results = mapper(_encode_rows, _chunks(chat_rows(cfg, stats), _CHUNK_ROWS))
            blocks: Iterable[tuple[np.ndarray, np.ndarray | None, np.ndarray]] = _chat_blocks(cfg, results, stats)
        else:
            stats = SourceStats()
            docs = iter_documents(cfg, stats)
            blocks = ((toks, None, lens) for toks, lens in
                      mapper(_encode_texts, _chunks(docs, _CHUNK_DOCS, len, _CHUNK_CHARS)))
        for toks, labs, lens in blocks:
            if not len(lens):
                continue
            tokens.write(toks)
            lengths.append(lens)
            max_id = max(max_id, int(toks.max()))
            if labels is not None:
                labels.write(labs)
                for lab in np.split(labs, np.cumsum(lens)[:-1]):
                    learned = np.flatnonzero(lab != IGNORE_INDEX)
                    first.append(int(learned[0]) if len(learned) else len(lab))
            progress.add(len(lens), len(toks))
    seconds = progress.close()
    files = {"tokens.bin": tokens.close()}
    if labels is not None:
        files["labels.bin"] = labels.close()
    if not lengths:
        what = stats.summary()
        raise UserError(f"{describe_source(cfg)} holds no {'usable conversations' if chat else 'documents'} "
                        f"({what})")
    offsets = _ArrayFile(tmp / "offsets.bin", np.int64)
    all_lengths = np.concatenate(lengths)
    offsets.write(np.concatenate([[0], np.cumsum(all_lengths)]))
    files["offsets.bin"] = offsets.close()
    if chat:
        fl = _ArrayFile(tmp / "first_label.bin", np.int32)
        fl.write(np.asarray(first, dtype=np.int32))
        files["first_label.bin"] = fl.close()
    n_tokens = tokens.size // 4
    log.info("token store: %s -> %d samples, %d tokens in %.1f s (%.0f tokens/s, %d worker%s)",
             stats.summary(), len(all_lengths), n_tokens, seconds, n_tokens / max(seconds, 1e-9), workers,
             "s" if workers != 1 else "")
    return {**fp, "samples": len(all_lengths), "tokens": n_tokens, "max_id": max_id, "stats": asdict(stats),
            "files": files, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _chat_blocks(cfg: DataConfig, results: Iterable[list[Any]], stats: ChatStats
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per chunk of tokenized rows, data.on_malformed applied in order: the kept samples as
    (ids, labels, lengths)."""
    for chunk in results:
        kept = [s for s in (apply_policy(cfg, r, stats) for r in chunk) if s is not None]
        if kept:
            yield (np.concatenate([i for i, _ in kept]), np.concatenate([lab for _, lab in kept]),
                   np.asarray([len(i) for i, _ in kept], dtype=np.int64))
    finish_policy(stats)


# -- the cache -------------------------------------------------------------------------------

@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created), held while preparing or checking a cached store;
    the kernel releases it if the holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def obtain(cfg: DataConfig, tokenizer: Tokenizer, workers: int = 1) -> TokenStore:
    """The store training reads for `[data]`.

    data.path naming a store folder: that store, after checking it was made with this tokenizer
    and, where its source files still exist, from their current contents. Otherwise the cached
    store of this source and tokenizer, prepared on first use (by whichever rank gets the lock
    first; the others wait and then open it).
    """
    if cfg.path and Path(cfg.path).expanduser().is_dir() and is_store(Path(cfg.path).expanduser()):
        store = open_store(Path(cfg.path).expanduser())
        check_fresh(store, cfg, tokenizer)
        return store
    fp = fingerprint(cfg, tokenizer)
    folder = cache_dir(cfg) / cache_key(fp)
    with _locked(folder.parent / f"{folder.name}.lock"):
        if (folder / MANIFEST).is_file():
            try:
                store = open_store(folder)
                log.info("data: token store %s (%d samples, %d tokens, prepared %s)", folder,
                         store.num_samples, store.num_tokens, store.manifest.get("created", "?"))
                return store
            except UserError as e:
                log.warning("data: the cached token store is unusable (%s); preparing it again", e)
        log.info("data: preparing the token store of %s into %s (data.cache_dir; `titanite data prepare` "
                 "does this ahead of time, in parallel)", describe_source(cfg), folder)
        return prepare(cfg, tokenizer, folder, workers, fp)


def check_fresh(store: TokenStore, cfg: DataConfig, tokenizer: Tokenizer) -> None:
    """Stop (UserError) when a named store does not match the tokenizer, the data kind, or a
    source file that still exists but changed since the store was prepared."""
    m = store.manifest
    if m["kind"] != _kind(cfg):
        raise UserError(f"data.path: the token store {store.path} holds {m['kind']} data, but data.format = "
                        f"{cfg.format!r} (set data.format = {'chat' if m['kind'] == 'chat' else 'auto'!r})")
    if m["tokenizer"] != _tokenizer_hash(cfg, tokenizer) or m["eos_id"] != tokenizer.eos_id:
        raise UserError(f"data.path: the token store {store.path} was prepared with another tokenizer than "
                        f"{tokenizer.path} (its files' hash differs); prepare it again with this one, or set "
                        "data.tokenizer to the one it was made with")
    keys = ("messages_field", "chat_loss", "on_malformed", "on_decode_error") if m["kind"] == "chat" else (
        "text_field", "on_decode_error")
    for key in keys:
        then, now = m["settings"].get(key), getattr(cfg, key)
        if then != now:
            raise UserError(f"data.{key}: the token store {store.path} was prepared with data.{key} = {then!r}, and "
                            f"this run sets {now!r}; prepare it again with this setting, or set it back")
    for src in m["sources"]:
        p = Path(src["path"])
        if p.exists():
            st = p.stat()
            if (st.st_size, st.st_mtime_ns) != (src["size"], src["mtime_ns"]):
                raise UserError(f"data.path: the token store {store.path} is stale: its source {p} changed "
                                f"since it was prepared ({src['size']} -> {st.st_size} bytes); prepare it again")

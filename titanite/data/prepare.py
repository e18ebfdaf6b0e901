"""Preparing token stores (store.py describes the format), and the cache of them.

`prepare` reads the configured source in order in this process (titanite's own readers, with
their decode and malformed-row policies) and tokenizes it in chunks, here or in worker
processes whose results come back in input order, so every worker count writes the same
bytes. A store is written into `<name>.tmp-<pid>/` and renamed into place after its manifest,
so a half-written store is never taken for a complete one; a later prepare removes the
leftovers of a killed one.

`obtain` keeps prepared stores in a cache (`data.cache_dir`) keyed by a hash of what the store
is made from, under a file lock, so every rank of a run uses the one store that the first rank
to get there prepared.
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from titanite.core.config import DataConfig
from titanite.core.errors import UserError
from titanite.core.files import is_within
from titanite.core.procs import forkserver_context
from titanite.data.chat import ChatStats, apply_policy, chat_rows, finish_policy, load_chat_template, tokenize_row
from titanite.data.chat_template import find_chat_template
from titanite.data.preference import preference_rows, tokenize_preference_row
from titanite.data.sources import SourceStats, describe_source, iter_documents
from titanite.data.store import (
    MANIFEST,
    TokenStore,
    cache_dir,
    cache_key,
    check_fresh,
    fingerprint,
    is_store,
    kind,
    open_store,
)
from titanite.data.tokenizer import Tokenizer, load_tokenizer
from titanite.kernels.reference_ops import IGNORE_INDEX

log = logging.getLogger("titanite")

_CHUNK_DOCS = 256  # documents per encode_batch call: enough to keep the Rust threads busy
_CHUNK_CHARS = 2_000_000  # ...or this many characters (about 1 s of work), whichever first
_CHUNK_ROWS = 64  # chat rows per worker task
_PROGRESS_EVERY_S = 5.0


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
    template = None
    if kind(cfg) == "chat":
        template = load_chat_template(cfg, tok)
    elif kind(cfg) == "preference":  # only conversational rows need one
        template = find_chat_template(tok.path, cfg.chat_template)
    _WORKER.update(cfg=cfg, tokenizer=tok, template=template)


def _encode_texts(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_documents(_WORKER["tokenizer"], docs)


def encode_documents(tok: Tokenizer, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Documents as (their tokens, each followed by the separator, int32; each one's length)."""
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


def _encode_pairs(rows: list[tuple[str, Any]]) -> list[Any]:
    w = _WORKER
    return [tokenize_preference_row(w["tokenizer"], w["template"], w["cfg"], where, row) for where, row in rows]


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
    # milliseconds, and none inherits the threads of this one (the tokenizer's, torch's). The
    # server dies with this process and the workers with the server, however this one dies.
    if kind(cfg) == "chat":
        load_chat_template(cfg, tokenizer)  # a missing or broken template: its message, here
    context = forkserver_context([__name__])
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
        if is_within(target, root) or is_within(root, target):
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
    chat = fp["kind"] != "text"  # chat and preference stores: samples with their own labels
    tokens = _ArrayFile(tmp / "tokens.bin", np.int32)
    labels = _ArrayFile(tmp / "labels.bin", np.int32) if chat else None
    lengths: list[np.ndarray] = []
    first: list[int] = []
    max_id = -1
    progress = _Progress(describe_source(cfg))
    stats: SourceStats | ChatStats
    with _mapper(cfg, tokenizer, workers) as mapper:
        if fp["kind"] == "preference":
            stats = ChatStats()
            results = mapper(_encode_pairs, _chunks(_counted(preference_rows(cfg, stats), stats), _CHUNK_ROWS))
            blocks = _chat_blocks(cfg, results, stats, pairs=True)
        elif chat:
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


def _counted(rows: Iterator[tuple[str, Any]], stats: ChatStats) -> Iterator[tuple[str, Any]]:
    for item in rows:
        stats.rows += 1
        yield item


def _chat_blocks(cfg: DataConfig, results: Iterable[list[Any]], stats: ChatStats, pairs: bool = False
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per chunk of tokenized rows, data.on_malformed applied in order: the kept samples as
    (ids, labels, lengths). `pairs`: each row is two samples (chosen, rejected), kept together."""
    for chunk in results:
        kept = [s for s in (apply_policy(cfg, r, stats) for r in chunk) if s is not None]
        if pairs:
            kept = [sample for pair in kept for sample in pair]
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



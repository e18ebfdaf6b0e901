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

This module is the format and reading; prepare.py writes stores and keeps the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from titanite.core.config import DataConfig
from titanite.core.errors import UserError
from titanite.core.files import file_digest
from titanite.data.chat import CHAT_GLOBS, ChatStats
from titanite.data.sources import SourceStats, input_files
from titanite.data.tokenizer import Tokenizer
from titanite.kernels.reference_ops import IGNORE_INDEX

log = logging.getLogger("titanite")

FORMAT = "titanite-token-store"
VERSION = 1
MANIFEST = "manifest.json"
# The [data] keys that change what a store holds (seq_len, packing and shuffling do not: they
# are applied when a store is read).
_SETTINGS = ("path", "dataset_name", "split", "format", "glob", "max_files", "text_field", "on_decode_error",
             "messages_field", "chat_loss", "on_malformed")
# Preference stores hold pairs already cut to data.seq_len (TRL's max_length), so these shape them too.
_PREFERENCE_SETTINGS = ("seq_len", "max_prompt_length", "max_completion_length", "truncation_mode")


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

def kind(cfg: DataConfig) -> str:
    """'chat', 'preference' or 'text': what a store of this [data] holds."""
    return cfg.format if cfg.format in ("chat", "preference") else "text"


def tokenizer_hash(cfg: DataConfig, tokenizer: Tokenizer) -> str:
    """SHA-256 over the tokenizer's files (tokenizer.json and its side files) and, for chat, the
    template file data.chat_template names."""
    h = hashlib.sha256()
    files = list(tokenizer.files)
    if kind(cfg) != "text" and cfg.chat_template:
        files.append(Path(cfg.chat_template).expanduser())
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def fingerprint(cfg: DataConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a store of this source and tokenizer is made from: the cache key is its hash."""
    files = input_files(cfg, CHAT_GLOBS if kind(cfg) != "text" else None)
    sources = []
    for f in files:
        st = f.stat()
        sources.append({"path": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    settings = {k: getattr(cfg, k) for k in _SETTINGS + (_PREFERENCE_SETTINGS if kind(cfg) == "preference" else ())}
    if cfg.path and not cfg.dataset_name and cfg.path != "<stdlib>":
        settings["path"] = str(Path(cfg.path).expanduser().resolve())
    return {"format": FORMAT, "version": VERSION, "kind": kind(cfg), "eos_id": tokenizer.eos_id,
            "tokenizer": tokenizer_hash(cfg, tokenizer), "settings": settings, "sources": sources}


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
        cls = SourceStats if self.kind == "text" else ChatStats
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
        if file_digest(path / name)["sha256"] != entry["sha256"]:
            raise UserError(f"token store file {path / name}: its SHA-256 differs from the manifest "
                            "(corrupt); prepare the store again")


def check_fresh(store: TokenStore, cfg: DataConfig, tokenizer: Tokenizer) -> None:
    """Stop (UserError) when a named store does not match the tokenizer, the data kind, or a
    source file that still exists but changed since the store was prepared."""
    m = store.manifest
    if m["kind"] != kind(cfg):
        raise UserError(f"data.path: the token store {store.path} holds {m['kind']} data, but data.format = "
                        f"{cfg.format!r} (set data.format = {'auto' if m['kind'] == 'text' else m['kind']!r})")
    if m["tokenizer"] != tokenizer_hash(cfg, tokenizer) or m["eos_id"] != tokenizer.eos_id:
        raise UserError(f"data.path: the token store {store.path} was prepared with another tokenizer than "
                        f"{tokenizer.path} (its files' hash differs); prepare it again with this one, or set "
                        "data.tokenizer to the one it was made with")
    keys = {"chat": ("messages_field", "chat_loss", "on_malformed", "on_decode_error"),
            "preference": ("on_malformed", "on_decode_error") + _PREFERENCE_SETTINGS}.get(
        m["kind"], ("text_field", "on_decode_error"))
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

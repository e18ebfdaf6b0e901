"""Packing: tokenize every document and join them into one flat token stream.

Each document is followed by the tokenizer's separator (`eos_id`, <|endoftext|> for Qwen3), so
the model learns where documents end. The stream is one int32 array: 4 bytes per token, no
per-document Python objects kept.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator

import numpy as np

from titanite.config import DataConfig
from titanite.data.sources import SourceStats, describe_source, iter_documents
from titanite.data.tokenizer import Tokenizer
from titanite.errors import UserError

log = logging.getLogger("titanite")

_CHUNK_DOCS = 256  # documents per encode_batch call: enough to keep the Rust threads busy
_CHUNK_CHARS = 2_000_000  # ...or this many characters (about 1 s of work), whichever first
_PROGRESS_EVERY_S = 5.0


def pack_documents(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[np.ndarray, SourceStats]:
    """All documents' token ids, each followed by `tokenizer.eos_id`.

    Returns (tokens int32 [T], stats). Raises UserError when the source holds no documents.
    """
    stats = SourceStats()
    parts: list[np.ndarray] = []
    n_tokens = 0
    start = last_report = time.monotonic()
    docs = iter_documents(cfg, stats)
    while chunk := _next_chunk(docs):
        ids = tokenizer.encode_batch(chunk)
        for doc in ids:
            doc.append(tokenizer.eos_id)
        count = sum(len(doc) for doc in ids)
        parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=count))
        n_tokens += count
        now = time.monotonic()
        if now - last_report >= _PROGRESS_EVERY_S:
            log.info("tokenizing %s: %d documents, %d tokens so far (%.0f s)",
                     describe_source(cfg), stats.documents, n_tokens, now - start)
            last_report = now
    if stats.documents == 0:
        raise UserError(f"{describe_source(cfg)} holds no documents ({stats.summary()})")
    tokens = np.concatenate(parts)
    assert tokens.shape == (n_tokens,)
    return tokens, stats


def _next_chunk(docs: Iterator[str]) -> list[str]:
    """Up to _CHUNK_DOCS documents (or _CHUNK_CHARS characters) from the stream; [] at the end."""
    chunk: list[str] = []
    chars = 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if len(chunk) >= _CHUNK_DOCS or chars >= _CHUNK_CHARS:
            break
    return chunk

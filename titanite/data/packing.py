"""Packing: turn documents or chat samples into fixed-length training sequences.

Two layouts, chosen by `data.packing`:

- stream (pretraining): every document is followed by the tokenizer's separator (`eos_id`,
  <|endoftext|> for Qwen3), so the model learns where documents end, and all are joined into
  one int32 token array (4 bytes per token, no per-document Python objects kept) that the
  loader cuts into windows. Attention runs across document boundaries, as is usual.
- documents / pad (fine-tuning): each sample (a chat conversation, or a document plus its
  separator) keeps its own labels. 'documents' packs whole samples greedily, in order, into
  windows of seq_len tokens: position ids restart at 0 for each sample and `document_ids` tell
  the model to attend only within a sample (block-causal). 'pad' puts one sample per window.
  Leftover room is padding with IGNORE_INDEX labels. A sample longer than seq_len is cut or
  dropped by `data.overlong`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from titanite.config import DataConfig
from titanite.data.chat import IGNORE_INDEX, ChatStats, chat_samples
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


def packing_mode(cfg: DataConfig) -> str:
    """data.packing with 'auto' resolved: 'documents' for chat data, 'stream' otherwise."""
    if cfg.packing != "auto":
        return cfg.packing
    return "documents" if cfg.format == "chat" else "stream"


@dataclass
class SampleStats:
    """What packing kept, cut and left out."""

    samples: int = 0  # samples placed in windows
    truncated: int = 0  # ...of which cut to seq_len
    dropped_overlong: int = 0  # longer than seq_len with data.overlong = 'drop'
    dropped_no_loss: int = 0  # no label left (e.g. the assistant turn was cut off)
    tokens: int = 0  # sample tokens placed (padding excluded)
    windows: int = 0

    def summary(self) -> str:
        return (f"{self.samples} samples ({self.truncated} truncated; dropped: {self.dropped_overlong} "
                f"over-long, {self.dropped_no_loss} with no loss tokens) in {self.windows} sequences")


class StreamWindows:
    """The 'stream' layout: the token stream cut into N windows of seq_len + 1 tokens (the
    incomplete tail dropped). `tokens` is a view of the one int32 buffer, [N, S + 1]."""

    def __init__(self, stream: np.ndarray, seq_len: int) -> None:
        width = seq_len + 1
        n = len(stream) // width
        self.tokens = stream[: n * width].reshape(n, width)
        # Every window is one causal sequence, so every batch has the same positions.
        self._positions = torch.arange(seq_len, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """Windows `idx` as int64 CPU tensors [B, S]: input_ids, labels (the inputs shifted by
        one) and position_ids."""
        window = torch.from_numpy(self.tokens[idx]).to(torch.int64)  # [B, S + 1]
        return {
            "input_ids": window[:, :-1].contiguous(),
            "labels": window[:, 1:].contiguous(),
            "position_ids": self._positions.expand(len(idx), -1).clone(),
        }


class SampleWindows:
    """Samples packed into fixed windows; all arrays int32 [N, S].

    position_ids and document_ids are None in 'pad' layout, where each window is one causal
    sequence starting at position 0.
    """

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray | None,
                 document_ids: np.ndarray | None) -> None:
        self.input_ids, self.labels = input_ids, labels
        self.position_ids, self.document_ids = position_ids, document_ids

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def batch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """Windows `idx` as int64 CPU tensors [B, S]: input_ids, labels, position_ids, and
        document_ids when samples share windows."""
        def take(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a[idx]).to(torch.int64)

        out = {"input_ids": take(self.input_ids), "labels": take(self.labels)}
        if self.position_ids is None:
            out["position_ids"] = torch.arange(self.seq_len, dtype=torch.int64).expand(len(idx), -1).clone()
        else:
            out["position_ids"] = take(self.position_ids)
        if self.document_ids is not None:
            out["document_ids"] = take(self.document_ids)
        return out


def build_sample_windows(cfg: DataConfig, tokenizer: Tokenizer, mode: str
                         ) -> tuple[SampleWindows, SourceStats | ChatStats, SampleStats]:
    """Read, tokenize and pack the configured source in 'documents' or 'pad' layout.

    Raises UserError when no sample survives.
    """
    assert mode in ("documents", "pad"), mode
    source_stats: SourceStats | ChatStats
    if cfg.format == "chat":
        source_stats = ChatStats()
        samples = chat_samples(cfg, tokenizer, source_stats)
    else:
        source_stats = SourceStats()
        samples = text_samples(cfg, tokenizer, source_stats)
    stats = SampleStats()
    windows = pack_samples(samples, cfg.seq_len, mode, cfg.overlong, tokenizer.eos_id, stats)
    if len(windows) == 0:
        raise UserError(f"{describe_source(cfg)} gives no training samples ({source_stats.summary()}; "
                        f"{stats.summary()})")
    return windows, source_stats, stats


def text_samples(cfg: DataConfig, tokenizer: Tokenizer,
                 stats: SourceStats) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each document plus the separator as one sample, every next token learned: (ids, labels)
    int32 [T], labels[t] = ids[t + 1] and IGNORE_INDEX at the end."""
    docs = iter_documents(cfg, stats)
    while chunk := _next_chunk(docs):
        for doc in tokenizer.encode_batch(chunk):
            ids = np.asarray(doc + [tokenizer.eos_id], dtype=np.int32)
            labels = np.empty_like(ids)
            labels[:-1], labels[-1] = ids[1:], IGNORE_INDEX
            yield ids, labels


def pack_samples(samples: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, mode: str,
                 overlong: str, pad_id: int, stats: SampleStats) -> SampleWindows:
    """Pack (ids, labels) samples, in order, into windows of `seq_len` tokens.

    'documents': a sample joins the current window when it fits, else it opens the next one.
    'pad': one sample per window. Padding is `pad_id` with IGNORE_INDEX labels; in the
    'documents' layout it forms a block of its own, so no sample attends to it.
    """
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    current: list[tuple[np.ndarray, np.ndarray]] = []
    used = 0

    def flush() -> None:
        rows.append(_window(current, seq_len, pad_id))
        current.clear()

    for ids, labels in samples:
        fitted = _fit(ids, labels, seq_len, overlong, stats)
        if fitted is None:
            continue
        if current and (mode == "pad" or used + len(fitted[0]) > seq_len):
            flush()
            used = 0
        current.append(fitted)
        used += len(fitted[0])
    if current:
        flush()
    stats.windows = len(rows)
    if not rows:
        empty = np.zeros((0, seq_len), dtype=np.int32)
        return SampleWindows(empty, empty.copy(), None, None)
    ids_, labels_, pos_, doc_ = (np.stack(col) for col in zip(*rows, strict=True))
    if mode == "pad":
        return SampleWindows(ids_, labels_, None, None)
    return SampleWindows(ids_, labels_, pos_, doc_)


def _fit(ids: np.ndarray, labels: np.ndarray, seq_len: int, overlong: str,
         stats: SampleStats) -> tuple[np.ndarray, np.ndarray] | None:
    """The sample cut to seq_len (or None when dropped), counted in `stats`."""
    cut = len(ids) > seq_len
    if cut:
        if overlong == "drop":
            stats.dropped_overlong += 1
            return None
        # labels[t] is the true next token even at the cut: it stays a valid target.
        ids, labels = ids[:seq_len], labels[:seq_len]
    if not (labels != IGNORE_INDEX).any():
        stats.dropped_no_loss += 1
        return None
    stats.samples += 1
    stats.truncated += cut
    stats.tokens += len(ids)
    return ids, labels


def _window(samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One window: ids, labels, position ids, document ids, each int32 [seq_len]."""
    ids = np.full(seq_len, pad_id, dtype=np.int32)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
    pos = np.empty(seq_len, dtype=np.int32)
    doc = np.empty(seq_len, dtype=np.int32)
    off = 0
    for k, (s_ids, s_labels) in enumerate(samples):
        n = len(s_ids)
        ids[off:off + n], labels[off:off + n] = s_ids, s_labels
        pos[off:off + n], doc[off:off + n] = np.arange(n), k
        off += n
    pos[off:], doc[off:] = np.arange(seq_len - off), len(samples)
    return ids, labels, pos, doc

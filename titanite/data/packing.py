"""Packing: turn a token store's samples into fixed-length training sequences, lazily.

Two layouts, chosen by `data.packing`:

- stream (pretraining): every document is followed by the tokenizer's separator (`eos_id`,
  <|endoftext|> for Qwen3), so the model learns where documents end, and all are joined into
  one int32 token array (the store's tokens.bin, memory-mapped) that is cut into windows of
  seq_len + 1 tokens. Attention runs across document boundaries, as is usual.
- documents / pad (fine-tuning): each sample (a chat conversation, or a document plus its
  separator) keeps its own labels. 'documents' packs whole samples greedily, in order, into
  windows of seq_len tokens: position ids restart at 0 for each sample and `document_ids` tell
  the model to attend only within a sample (block-causal). 'pad' puts one sample per window.
  Leftover room is padding with IGNORE_INDEX labels. A sample longer than seq_len is cut or
  dropped by `data.overlong`.

Only the plan (which samples form which window: a few int64 per sample, computed from the
store's offsets) is held in memory; a window's tokens are read from the store when it is
served.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from titanite.core.config import DataConfig
from titanite.core.errors import UserError
from titanite.data.chat import IGNORE_INDEX, ChatStats
from titanite.data.prepare import obtain
from titanite.data.sources import SourceStats, describe_source
from titanite.data.store import TokenStore
from titanite.data.tokenizer import Tokenizer


def packing_mode(cfg: DataConfig) -> str:
    """data.packing with 'auto' resolved: 'documents' for chat data (any source of a mixture),
    'stream' otherwise; preference data is always 'pairs' (one padded sequence per completion)."""
    if cfg.format == "preference":
        return "pairs"
    if cfg.packing != "auto":
        return cfg.packing
    formats = [src.get("format", cfg.format) for src in cfg.sources] or [cfg.format]
    return "documents" if "chat" in formats else "stream"


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
    incomplete tail dropped). `tokens` is a view of the store's int32 tokens, [N, S + 1]."""

    def __init__(self, stream: np.ndarray, seq_len: int, store: TokenStore | None = None) -> None:
        self.store = store
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
        rows = np.asarray(self.tokens[idx])
        if self.store is not None:
            self.store.check_ids(rows, f"windows {np.asarray(idx).tolist()}")
        window = torch.from_numpy(rows).to(torch.int64)  # [B, S + 1]
        return {
            "input_ids": window[:, :-1].contiguous(),
            "labels": window[:, 1:].contiguous(),
            "position_ids": self._positions.expand(len(idx), -1).clone(),
        }


class SampleWindows:
    """Samples of a store packed into fixed windows of `seq_len`, built when served.

    Args:
        store: the token store.
        kept: int64 [K] store sample indices that are packed, in order.
        fitted: int64 [K] each one's length after cutting to seq_len.
        starts: int64 [N + 1] window w holds kept[starts[w]:starts[w + 1]].
        pad: 'pad' layout (one causal sequence per window from position 0, no document ids).
    """

    def __init__(self, store: TokenStore, kept: np.ndarray, fitted: np.ndarray, starts: np.ndarray,
                 seq_len: int, pad_id: int, pad: bool) -> None:
        self.store, self.kept, self.fitted, self.starts = store, kept, fitted, starts
        self.seq_len, self.pad_id, self.pad = seq_len, pad_id, pad

    def __len__(self) -> int:
        return len(self.starts) - 1

    def window(self, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Window w: ids, labels, position ids, document ids, each int32 [seq_len]."""
        S = self.seq_len
        ids = np.full(S, self.pad_id, dtype=np.int32)
        labels = np.full(S, IGNORE_INDEX, dtype=np.int32)
        pos = np.empty(S, dtype=np.int32)
        doc = np.empty(S, dtype=np.int32)
        off = 0
        first, last = int(self.starts[w]), int(self.starts[w + 1])
        for k, j in enumerate(range(first, last)):
            n = int(self.fitted[j])
            s_ids, s_labels = self.store.sample(int(self.kept[j]))
            ids[off:off + n], labels[off:off + n] = s_ids[:n], s_labels[:n]
            pos[off:off + n], doc[off:off + n] = np.arange(n), k
            off += n
        pos[off:], doc[off:] = np.arange(S - off), last - first
        return ids, labels, pos, doc

    def batch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """Windows `idx` as int64 CPU tensors [B, S]: input_ids, labels, position_ids, and
        document_ids when samples share windows."""
        ids, labels, pos, doc = (torch.from_numpy(np.stack(col)).to(torch.int64)
                                 for col in zip(*(self.window(int(w)) for w in idx), strict=True))
        out = {"input_ids": ids, "labels": labels}
        if self.pad:
            out["position_ids"] = torch.arange(self.seq_len, dtype=torch.int64).expand(len(idx), -1).clone()
        else:
            out["position_ids"], out["document_ids"] = pos, doc
        return out


class PairWindows:
    """The 'pairs' layout of preference data: the store holds each pair as two samples (chosen,
    rejected), already cut to seq_len when prepared; item i of this layout is pair i."""

    def __init__(self, store: TokenStore, seq_len: int, pad_id: int) -> None:
        lengths = store.sample_lengths().astype(np.int64)
        n = len(lengths)
        assert n % 2 == 0 and (lengths <= seq_len).all(), "a preference store holds pairs cut to seq_len"
        self.samples = SampleWindows(store, np.arange(n, dtype=np.int64), lengths,
                                     np.arange(n + 1, dtype=np.int64), seq_len, pad_id, pad=True)

    def __len__(self) -> int:
        return len(self.samples) // 2

    def batch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """Pairs `idx` (B of them) as 2B rows [B chosen, then B rejected], int64 CPU [2B, S]:
        input_ids, labels, position_ids; and pair_index [B], the pairs' indices in the store."""
        idx = np.asarray(idx, dtype=np.int64)
        out = self.samples.batch(np.concatenate([2 * idx, 2 * idx + 1]))
        out["pair_index"] = torch.from_numpy(idx.copy())
        return out


def plan_sample_windows(store: TokenStore, seq_len: int, mode: str, overlong: str, pad_id: int,
                        stats: SampleStats) -> SampleWindows:
    """Pack the store's samples, in order, into windows of `seq_len` tokens.

    'documents': a sample joins the current window when it fits, else it opens the next one.
    'pad': one sample per window. A sample longer than seq_len is cut (labels[t] stays the true
    next token at the cut) or, with overlong = 'drop', left out; a sample with no learned label
    left after the cut is left out. Padding is `pad_id` with IGNORE_INDEX labels; in the
    'documents' layout it forms a block of its own, so no sample attends to it.
    """
    assert mode in ("documents", "pad"), mode
    lengths = store.sample_lengths().astype(np.int64)
    fitted = np.minimum(lengths, seq_len)
    cut = lengths > seq_len
    dropped = cut if overlong == "drop" else np.zeros_like(cut)
    has_loss = store.first_learned() < fitted
    keep = ~dropped & has_loss
    kept = np.flatnonzero(keep).astype(np.int64)
    fitted = fitted[kept]
    if mode == "pad":
        starts = np.arange(len(kept) + 1, dtype=np.int64)
    else:
        starts_list = [0]
        used = 0
        for j, n in enumerate(fitted.tolist()):
            if used + n > seq_len:
                starts_list.append(j)
                used = 0
            used += n
        starts_list.append(len(kept))
        starts = np.asarray(starts_list if len(kept) else [0], dtype=np.int64)
    stats.samples = len(kept)
    stats.truncated = int(cut[kept].sum())
    stats.dropped_overlong = int(dropped.sum())
    stats.dropped_no_loss = int((~dropped & ~has_loss).sum())
    stats.tokens = int(fitted.sum())
    stats.windows = len(starts) - 1
    return SampleWindows(store, kept, fitted, starts, seq_len, pad_id, pad=mode == "pad")


@dataclass
class Packed:
    """A source's windows, and what reading and packing it kept and left out."""

    windows: StreamWindows | SampleWindows | PairWindows
    store: TokenStore
    source_stats: SourceStats | ChatStats
    sample_stats: SampleStats | None  # None in the 'stream' layout
    num_tokens: int


def pack(cfg: DataConfig, tokenizer: Tokenizer, mode: str | None = None) -> Packed:
    """The windows of the configured source (its token store, prepared on first use).

    Raises UserError when nothing survives packing.
    """
    mode = mode or packing_mode(cfg)
    store = obtain(cfg, tokenizer)
    source_stats = store.source_stats()
    if mode == "stream":
        return Packed(StreamWindows(store.tokens, cfg.seq_len, store), store, source_stats, None, store.num_tokens)
    if mode == "pairs":
        if store.kind != "preference":
            raise UserError(f"data.path: the token store {store.path} holds {store.kind} data, not preference pairs")
        pairs = PairWindows(store, cfg.seq_len, tokenizer.eos_id)
        stats = SampleStats(samples=len(pairs), tokens=store.num_tokens, windows=2 * len(pairs))
        return Packed(pairs, store, source_stats, stats, store.num_tokens)
    stats = SampleStats()
    windows = plan_sample_windows(store, cfg.seq_len, mode, cfg.overlong, tokenizer.eos_id, stats)
    if len(windows) == 0:
        raise UserError(f"{describe_source(cfg)} gives no training samples ({source_stats.summary()}; "
                        f"{stats.summary()})")
    return Packed(windows, store, source_stats, stats, stats.tokens)

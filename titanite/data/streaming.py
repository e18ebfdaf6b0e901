"""Streaming: read and tokenize a source while training, for data too big to prepare.

`data.streaming = true` reads the configured source in order (files one at a time; a hub
dataset through `datasets`' streaming mode) and tokenizes it in chunks as batches are needed,
with no token store. Documents are joined with the separator and cut into consecutive windows
of seq_len + 1 tokens: the 'stream' layout, in the same order a store of the same source gives
with data.shuffle = false (so the two serve the same windows, until the end of the first
epoch). At the end of the source the next epoch starts from its beginning; the tail of one
epoch runs on into the next.

The position is three integers: the epoch, the index of the first document not yet fully
consumed, and how many of its tokens were. A resume skips that many documents (reading them,
without tokenizing) and continues exactly. Every data-parallel rank reads the whole stream
and keeps its batch_size share of each global batch, so the global order does not depend on
the number of ranks; the price is that every rank tokenizes everything.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titanite.core.config import DataConfig
from titanite.core.errors import UserError
from titanite.data.position import check_position
from titanite.data.prepare import encode_documents
from titanite.data.sources import SourceStats, describe_source, iter_documents
from titanite.data.store import is_store
from titanite.data.tokenizer import Tokenizer

log = logging.getLogger("titanite")

_CHUNK_DOCS = 64  # documents per encode_batch call


class StreamingLoader:
    """Endless batches tokenized on the fly; the PackedLoader interface."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        assert batch_size > 0 and 0 <= rank < world_size, (batch_size, rank, world_size)
        if cfg.path and Path(cfg.path).expanduser().is_dir() and is_store(Path(cfg.path).expanduser()):
            raise UserError(f"data.path: {cfg.path} is a token store, which is read as prepared: set "
                            "data.streaming = false to train on it (streaming reads the sources themselves)")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.seq_len, self.batch_size, self.rank = cfg.seq_len, batch_size, rank
        self.global_batch_size = batch_size * world_size
        self.packing = "stream"
        self.epoch, self.windows = 0, 0
        self.first_doc, self.head_offset = 0, 0  # the position: see the module docstring
        self._pending: collections.deque[np.ndarray] = collections.deque()
        self._docs: Iterator[str] | None = None
        self._next_doc = 0  # index (in this epoch) of the next document the iterator yields
        self._positions = torch.arange(self.seq_len, dtype=torch.int64)
        self.stats = SourceStats()
        log.info("data: streaming %s (tokenized while training, in order, no shuffling)", describe_source(cfg))

    def _open(self) -> None:
        """Start reading this epoch at document `first_doc` (skipped without tokenizing)."""
        self._docs = iter_documents(self.cfg, self.stats)
        skipped = sum(1 for _ in itertools.islice(self._docs, self.first_doc))
        if skipped < self.first_doc:
            raise UserError(f"{describe_source(self.cfg)}: the checkpoint's position is document {self.first_doc} "
                            f"of epoch {self.epoch}, but the source now has {skipped}; resume with the same data")
        self._next_doc = self.first_doc

    def _read_chunk(self) -> bool:
        """Tokenize the next documents into the pending queue; False at the end of the source."""
        if self._docs is None:
            self._open()
        assert self._docs is not None
        chunk = list(itertools.islice(self._docs, _CHUNK_DOCS))
        if not chunk:
            return False
        tokens, lengths = encode_documents(self.tokenizer, chunk)
        self._pending.extend(np.split(tokens, np.cumsum(lengths)[:-1]))
        self._next_doc += len(chunk)
        return True

    def _take(self, n: int) -> np.ndarray:
        """The next n tokens of the stream, epochs rolling over."""
        out, have = [], 0
        while have < n:
            if not self._pending:
                if not self._read_chunk():
                    if self._next_doc == 0:
                        raise UserError(f"{describe_source(self.cfg)} holds no documents")
                    self.epoch, self.first_doc, self._next_doc, self._docs = self.epoch + 1, 0, 0, None
                    continue
            head = self._pending[0][self.head_offset:]
            use = min(len(head), n - have)
            out.append(head[:use])
            have += use
            if use == len(head):
                self._pending.popleft()
                self.first_doc, self.head_offset = self.first_doc + 1, 0
            else:
                self.head_offset += use
        return np.concatenate(out)

    def next_batch(self) -> dict[str, torch.Tensor]:
        width = self.seq_len + 1
        block = self._take(self.global_batch_size * width).reshape(self.global_batch_size, width)
        self.windows += self.global_batch_size
        mine = torch.from_numpy(block[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]).to(torch.int64)
        return {"input_ids": mine[:, :-1].contiguous(), "labels": mine[:, 1:].contiguous(),
                "position_ids": self._positions.expand(self.batch_size, -1).clone()}

    def __iter__(self) -> StreamingLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_batch()

    def data_metrics(self) -> dict[str, float]:
        return {"data_epoch": self.epoch}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "streaming", "epoch": self.epoch, "document": self.first_doc, "offset": self.head_offset,
                "windows": self.windows, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_position(state, "streaming", self.seq_len)
        self.epoch, self.first_doc, self.windows = int(state["epoch"]), int(state["document"]), int(state["windows"])
        self._pending.clear()
        self._docs = None
        self.head_offset = 0
        if state["offset"]:  # part of that document was consumed: read it and skip those tokens
            self._read_chunk()
            self.head_offset = int(state["offset"])

"""The stateful training loader: packed token windows served as per-rank batches.

In the 'stream' layout (see packing.py) the token stream is cut into non-overlapping windows
of seq_len + 1 tokens; a window's first seq_len tokens are the input and its last seq_len the
labels. In the 'documents' and 'pad' layouts the windows are packed samples with their own
labels, position ids and (for 'documents') document ids. Each epoch
orders the windows (a seeded permutation, or sequentially) and serves them in global batches
of G = batch_size * world_size windows; data-parallel rank r takes the r-th contiguous
batch_size share of each. The position is kept in global batches, so a checkpoint taken on
one world size resumes on another with the same global sample order.

The windows come from the source's token store (store.py), memory-mapped. `make_loader` picks
this loader, a weighted mixture of sources (mixture.py) or a stream tokenized while training
(streaming.py); the trainer wraps whichever it gets in a prefetching thread (prefetch.py).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from titanite.core.config import DataConfig
from titanite.core.errors import UserError
from titanite.data.mixture import MixtureLoader
from titanite.data.packing import SampleWindows, StreamWindows, pack, packing_mode
from titanite.data.position import check_position, mix_seed
from titanite.data.sources import describe_source
from titanite.data.streaming import StreamingLoader
from titanite.data.tokenizer import Tokenizer

log = logging.getLogger("titanite")

_STATE_KEYS = ("epoch", "position", "global_batch_size", "num_windows", "num_tokens", "seq_len")


class PackedLoader:
    """Endless iterator of batches; epochs roll over by themselves.

    Args:
        cfg: the [data] config (source, tokenizer-independent settings, seq_len, shuffle).
        tokenizer: from `load_tokenizer`: `encode_batch` and `eos_id` (the separator, and the
            padding id), and for chat data the tokenizer.json its chat template encodes with.
        batch_size: sequences per batch on this rank.
        seed: shuffling seed (job.seed); epoch e uses a permutation seeded from (seed, e).
        rank, world_size: this rank among the data-parallel ranks (not TP/EP ranks).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        assert batch_size > 0 and 0 <= rank < world_size, (batch_size, rank, world_size)
        self.seq_len = cfg.seq_len
        self.shuffle = cfg.shuffle
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.global_batch_size = batch_size * world_size

        self.packing = packing_mode(cfg)
        packed = pack(cfg, tokenizer, self.packing)
        self.windows: StreamWindows | SampleWindows = packed.windows
        self.store, self.stats, self.sample_stats = packed.store, packed.source_stats, packed.sample_stats
        self.num_tokens = packed.num_tokens
        self.num_windows = len(self.windows)
        self.batches_per_epoch = self.num_windows // self.global_batch_size
        if self.batches_per_epoch == 0:
            if self.sample_stats is None:
                width = cfg.seq_len + 1
                need = width * self.global_batch_size
                raise UserError(
                    f"{describe_source(cfg)} has {self.num_tokens} tokens, but one global batch needs "
                    f"{need}: (data.seq_len {cfg.seq_len} + 1) x {self.global_batch_size} sequences "
                    f"({batch_size} per rank x {world_size} ranks). Add data or lower data.seq_len "
                    "or training.batch_size")
            raise UserError(
                f"{describe_source(cfg)} packs into {self.num_windows} sequences (data.packing = "
                f"'{self.packing}', {self.sample_stats.summary()}), but one global batch needs "
                f"{self.global_batch_size} ({batch_size} per rank x {world_size} ranks). Add data or "
                "lower training.batch_size")
        if self.sample_stats is None:
            log.info("data: %s; %d tokens -> %d sequences of %d tokens, %d global batches per epoch",
                     self.stats.summary(), self.num_tokens, self.num_windows, cfg.seq_len,
                     self.batches_per_epoch)
        else:
            log.info("data: %s; %s ('%s' packing, %.1f%% of positions are tokens), %d global "
                     "batches per epoch", self.stats.summary(), self.sample_stats.summary(), self.packing,
                     100 * self.fill(), self.batches_per_epoch)

        self.epoch = 0
        self.position = 0  # global batches already served in this epoch
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def fill(self) -> float:
        """Fraction of window positions that hold sample tokens rather than padding."""
        rows = self.sample_stats.windows if self.sample_stats is not None else self.num_windows
        return self.num_tokens / max(1, rows * self.seq_len)

    def data_metrics(self) -> dict[str, float]:
        """Counts for metrics.jsonl in the sample layouts (what was cut, dropped or skipped)."""
        if self.sample_stats is None:
            return {}
        s = self.sample_stats
        return {"data_samples": s.samples, "data_truncated": s.truncated,
                "data_dropped": s.dropped_overlong + s.dropped_no_loss,
                "data_malformed": getattr(self.stats, "malformed_skipped", 0), "data_fill": self.fill()}

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's next batch: input_ids, labels, position_ids, each int64 CPU [B, S], plus
        document_ids [B, S] in the 'documents' layout."""
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        start = self.position * self.global_batch_size + self.rank * self.batch_size
        idx = self._epoch_order()[start : start + self.batch_size]
        self.position += 1
        return self.windows.batch(idx)

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_batch()

    def _epoch_order(self) -> np.ndarray:
        """Window indices for the current epoch, int64 [num_windows]; computed once per epoch."""
        if self._order_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
                self._order = torch.randperm(self.num_windows, generator=g).numpy()
            else:
                self._order = np.arange(self.num_windows)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def state_dict(self) -> dict[str, int]:
        """Plain ints (JSON-able): where the global sample order stands, and what data it is over."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "global_batch_size": self.global_batch_size,
            "num_windows": self.num_windows,
            "num_tokens": self.num_tokens,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` output, possibly saved under another world size.

        Raises UserError when the data, seq_len or batch layout make the old position meaningless.
        """
        check_position(state, "packed", self.seq_len)
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise UserError(f"checkpoint data-loader state lacks {missing}: not a PackedLoader state")
        s = {k: int(state[k]) for k in _STATE_KEYS}
        if (s["num_windows"], s["num_tokens"]) != (self.num_windows, self.num_tokens):
            raise UserError(
                f"the data changed since the checkpoint: it now packs into {self.num_windows} "
                f"sequences ({self.num_tokens} tokens), the checkpoint had {s['num_windows']} "
                f"({s['num_tokens']} tokens). Resume with the same data.path and tokenizer, or "
                "start a new job.output_dir")
        samples = s["position"] * s["global_batch_size"]
        if samples % self.global_batch_size:
            raise UserError(
                f"cannot resume: the checkpoint is {samples} sequences into epoch {s['epoch']}, "
                f"which is not a whole number of global batches of {self.global_batch_size} "
                "(training.batch_size x data-parallel ranks); keep the global batch size a "
                "divisor of that")
        self.epoch = s["epoch"]
        self.position = samples // self.global_batch_size
        assert self.position <= self.batches_per_epoch, (self.position, self.batches_per_epoch)


def make_loader(cfg: DataConfig, tokenizer: Tokenizer, batch_size: int, seed: int, rank: int = 0,
                world_size: int = 1) -> PackedLoader | MixtureLoader | StreamingLoader:
    """The training loader for `[data]`: a mixture when data.sources is set, a stream when
    data.streaming is, else one prepared source."""
    if cfg.sources:
        return MixtureLoader(cfg, tokenizer, batch_size, seed, rank, world_size)
    if cfg.streaming:
        return StreamingLoader(cfg, tokenizer, batch_size, seed, rank, world_size)
    return PackedLoader(cfg, tokenizer, batch_size, seed, rank, world_size)

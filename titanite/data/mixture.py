"""Weighted mixtures: several sources, each drawn with a weight, in one deterministic order.

`[[data.sources]]` tables (path, weight, optional name / format / text_field / glob) share the
rest of `[data]`. Each source has its own token store and its own packed windows, and cycles
through them in its own epochs (a seeded permutation per source and epoch, or in order when
data.shuffle is off). Which source fills global sample n is drawn from the normalised
weights by a generator seeded from (job.seed, n // BLOCK): the draw depends on the sample's
index alone, not on the batch size or the number of ranks. Data-parallel rank r takes the
r-th batch_size share of each global batch, as the single-source loader does.

The position is the number of global samples served plus how many windows each source has
given so far; both are plain integers in every checkpoint, so a resume (on any world size
with a global batch that divides the position) continues the same global order exactly.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from titanite.core.config import Config, DataConfig
from titanite.core.errors import UserError
from titanite.data.packing import Packed, SampleWindows, pack, packing_mode
from titanite.data.position import check_position, mix_seed
from titanite.data.tokenizer import Tokenizer

log = logging.getLogger("titanite")

BLOCK = 4096  # samples whose sources one seeded draw decides


def source_configs(cfg: DataConfig) -> list[tuple[str, float, DataConfig]]:
    """(name, weight, its own [data]) per source of data.sources."""
    out = []
    for src in cfg.sources:
        own = {k: src[k] for k in ("format", "text_field", "glob") if k in src}
        out.append((src["name"], float(src["weight"]),
                    dataclasses.replace(cfg, path=src["path"], dataset_name="", sources=[], **own)))
    return out


def eval_data_config(cfg: Config) -> DataConfig:
    """The [data] that eval.path is read with: the training data's settings, with a mixture's
    format when its sources share one (the packing follows the training data's)."""
    formats = {src.get("format", cfg.data.format) for src in cfg.data.sources}
    fmt = formats.pop() if len(formats) == 1 else cfg.data.format
    return dataclasses.replace(cfg.data, path=cfg.eval.path, dataset_name="", sources=[], streaming=False, format=fmt)


def run_data_configs(cfg: Config) -> list[tuple[str, DataConfig]]:
    """(config key, its [data]) for everything a run reads: data.path or each of data.sources,
    and eval.path."""
    if cfg.data.sources:
        out = [(f"data.sources[{i}].path", own) for i, (_, _, own) in enumerate(source_configs(cfg.data))]
    else:
        out = [("data.path", cfg.data)]
    return out + ([("eval.path", eval_data_config(cfg))] if cfg.eval.path else [])


class MixtureLoader:
    """Endless batches drawn from weighted sources; the PackedLoader interface."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        assert batch_size > 0 and 0 <= rank < world_size, (batch_size, rank, world_size)
        self.seq_len, self.shuffle, self.seed = cfg.seq_len, cfg.shuffle, seed
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.global_batch_size = batch_size * world_size
        self.packing = packing_mode(cfg)
        self.names, weights, self.parts = [], [], []
        for name, weight, own in source_configs(cfg):
            if own.format == "chat" and self.packing == "stream":
                raise UserError(f"data.sources: {name!r} is chat data, which needs data.packing = 'documents' "
                                "or 'pad' (not 'stream')")
            packed: Packed = pack(own, tokenizer, self.packing)
            if len(packed.windows) == 0:
                raise UserError(f"data.sources: {name!r} ({own.path}) has fewer than data.seq_len + 1 = "
                                f"{cfg.seq_len + 1} tokens: not one sequence")
            self.names.append(name)
            weights.append(weight)
            self.parts.append(packed)
        self.weights = torch.tensor(weights, dtype=torch.float64) / sum(weights)
        self.num_windows = [len(p.windows) for p in self.parts]
        self.num_tokens = sum(p.num_tokens for p in self.parts)
        self.samples = 0  # global samples served
        self.drawn = [0] * len(self.parts)  # windows each source has given
        self.tokens_drawn = [0] * len(self.parts)
        self._block: tuple[int, np.ndarray] | None = None
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        log.info("data: a mixture of %d sources (%s packing): %s", len(self.parts), self.packing, "; ".join(
            f"{n} weight {w:.3f}, {p.source_stats.summary()}, {len(p.windows)} sequences"
            for n, w, p in zip(self.names, self.weights.tolist(), self.parts)))

    # -- the order ---------------------------------------------------------------------------

    def _source_of(self, n: int) -> int:
        block = n // BLOCK
        if self._block is None or self._block[0] != block:
            g = torch.Generator().manual_seed(mix_seed(self.seed, block))
            picks = torch.multinomial(self.weights, BLOCK, replacement=True, generator=g).numpy()
            self._block = (block, picks)
        return int(self._block[1][n % BLOCK])

    def _window_of(self, s: int, k: int) -> int:
        """The window source s gives the k-th time it is drawn."""
        n = self.num_windows[s]
        epoch = k // n
        if not self.shuffle:
            return k % n
        if (s, epoch) not in self._orders:
            self._orders = {key: v for key, v in self._orders.items() if key[0] != s}  # one epoch per source kept
            g = torch.Generator().manual_seed(mix_seed(self.seed, s, epoch))
            self._orders[(s, epoch)] = torch.randperm(n, generator=g).numpy()
        return int(self._orders[(s, epoch)][k % n])

    def _window_tokens(self, s: int, w: int) -> int:
        windows = self.parts[s].windows
        if isinstance(windows, SampleWindows):
            return int(windows.fitted[windows.starts[w]:windows.starts[w + 1]].sum())
        return self.seq_len

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's share of the next global batch (the PackedLoader batch keys)."""
        mine: list[tuple[int, int]] = []
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for i in range(self.global_batch_size):
            s = self._source_of(self.samples + i)
            w = self._window_of(s, self.drawn[s])
            self.drawn[s] += 1
            self.tokens_drawn[s] += self._window_tokens(s, w)
            if lo <= i < hi:
                mine.append((s, w))
        self.samples += self.global_batch_size
        rows = [self.parts[s].windows.batch(np.array([w])) for s, w in mine]
        return {key: torch.cat([r[key] for r in rows]) for key in rows[0]}

    def __iter__(self) -> MixtureLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_batch()

    # -- metrics and state -------------------------------------------------------------------

    def data_metrics(self) -> dict[str, float]:
        """Tokens drawn from each source so far (sequence tokens, padding excluded), every rank's
        share included."""
        return {f"data/{n}/tokens": t for n, t in zip(self.names, self.tokens_drawn)}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixture", "samples": self.samples, "drawn": list(self.drawn),
                "tokens_drawn": list(self.tokens_drawn), "names": list(self.names),
                "num_windows": list(self.num_windows), "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_position(state, "mixture", self.seq_len)
        if (state["names"], state["num_windows"]) != (self.names, self.num_windows):
            raise UserError(f"the mixture changed since the checkpoint: sources {state['names']} with "
                            f"{state['num_windows']} sequences then, {self.names} with {self.num_windows} now; "
                            "resume with the same data.sources, or start a new job.output_dir")
        if state["samples"] % self.global_batch_size:
            raise UserError(f"cannot resume: the checkpoint is {state['samples']} sequences in, which is not a "
                            f"whole number of global batches of {self.global_batch_size} (training.batch_size x "
                            "data-parallel ranks)")
        self.samples = int(state["samples"])
        self.drawn = [int(x) for x in state["drawn"]]
        self.tokens_drawn = [int(x) for x in state["tokens_drawn"]]

"""Evaluation on held-out data: loss and perplexity every `eval.interval` steps and at the end.

The held-out source (`eval.path`) is read with the training `[data]` settings (format, packing,
seq_len, chat template and loss policy), so the two losses are comparable. It is packed once,
in order, and every evaluation covers the same sequences: all of them, or the first
`eval.max_batches` global batches. The loss is the summed token cross-entropy over every
valid label divided by the number of such labels (over all data-parallel ranks);
perplexity is exp(loss).

Benchmarks (`eval.tasks`, `titanite eval`) go through lm-evaluation-harness: titanite/evaluation/harness.py,
once `require_lm_eval` has found it installed.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from titanite.core.config import Config
from titanite.core.errors import UserError
from titanite.data.mixture import eval_data_config
from titanite.data.packing import PairWindows, SampleWindows, StreamWindows, pack, packing_mode
from titanite.data.tokenizer import Tokenizer
from titanite.kernels import IGNORE_INDEX

log = logging.getLogger("titanite")
LM_EVAL = "lm-eval==0.4.13"  # the version titanite's harness is written and tested against


def require_lm_eval(key: str) -> None:
    """Raise UserError, naming `key`, when lm-evaluation-harness is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(f"{key} needs lm-evaluation-harness, which is not installed: "
                        f"pip install 'titanite[eval]' (or {LM_EVAL})")


def eval_due(step: int, interval: int, total_steps: int) -> bool:
    """Whether to evaluate after optimizer step `step`: every `interval` steps, and the last."""
    return step == total_steps or (interval > 0 and step % interval == 0)


class Evaluator:
    """Held-out batches for this data-parallel rank, and the loop that scores them.

    Args:
        cfg: the run config; `cfg.eval.path` must be set.
        tokenizer: the training tokenizer.
        dp_rank, dp_size: this rank among the data-parallel ranks. Every rank runs the same
            number of forwards (short batches are filled with label-free rows), so sharded
            models stay in step.
    """

    def __init__(self, cfg: Config, tokenizer: Tokenizer, dp_rank: int = 0, dp_size: int = 1) -> None:
        e = cfg.eval
        assert e.path, "Evaluator needs eval.path"
        data = eval_data_config(cfg)  # read as the training data is, with its packing
        packed = pack(data, tokenizer, packing_mode(cfg.data))
        self.windows: StreamWindows | SampleWindows | PairWindows = packed.windows
        self.store = packed.store
        if len(self.windows) == 0:
            raise UserError(f"eval.path = {e.path!r} has fewer than data.seq_len + 1 = "
                            f"{data.seq_len + 1} tokens: not one sequence to evaluate on")
        self.batch_size = e.batch_size or cfg.training.batch_size
        self.rank, self.global_batch = dp_rank, self.batch_size * dp_size
        self.num_batches = math.ceil(len(self.windows) / self.global_batch)
        if e.max_batches:
            self.num_batches = min(self.num_batches, e.max_batches)
        log.info("eval: %s -> %d sequences of %d tokens, %d batches of %d per rank",
                 e.path, len(self.windows), data.seq_len, self.num_batches, self.batch_size)

    def batches(self) -> list[dict[str, torch.Tensor]]:
        """This rank's eval batches (CPU int64 [B, S] tensors), the same list every time."""
        out = []
        n = len(self.windows)
        for g in range(self.num_batches):
            start = g * self.global_batch + self.rank * self.batch_size
            idx = np.arange(start, start + self.batch_size)
            valid = torch.from_numpy(idx < n)
            batch = self.windows.batch(np.minimum(idx, n - 1))
            # Rows past the end repeat the last window with no labels: they cost a forward but
            # add nothing to the loss or the token count.
            if "pair_index" in batch:  # preference pairs: B chosen rows, then B rejected rows
                batch["pair_valid"] = valid
                valid = torch.cat([valid, valid])
            batch["labels"] = torch.where(valid[:, None], batch["labels"], IGNORE_INDEX)
            out.append(batch)
        return out

    @torch.no_grad()
    def run(self, model: nn.Module, loss_sum: Callable[[dict[str, torch.Tensor]], torch.Tensor],
            all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> dict[str, float]:
        """Score the held-out data.

        Args:
            model: put in eval mode for the duration, then back in train mode.
            loss_sum: a CPU batch -> summed cross-entropy over its valid labels (fp32 scalar).
            all_reduce_sum: sums a tensor over the data-parallel ranks.
        Returns {"eval_loss", "eval_ppl", "eval_tokens"}.
        """
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, valid labels]
        try:
            for batch in self.batches():
                total[0] += loss_sum(batch).double()
                total[1] += int((batch["labels"] != IGNORE_INDEX).sum())
        finally:
            model.train(was_training)
        total = all_reduce_sum(total)
        loss_value, tokens = float(total[0]), int(total[1])
        loss_value = loss_value / max(tokens, 1)
        ppl = math.exp(loss_value) if loss_value < 700 else math.inf  # exp overflows past ~709
        log.info("eval: loss %.4f, perplexity %.3f over %d tokens (%.1f s)", loss_value, ppl, tokens,
                 time.perf_counter() - start)
        return {"eval_loss": loss_value, "eval_ppl": ppl, "eval_tokens": tokens}

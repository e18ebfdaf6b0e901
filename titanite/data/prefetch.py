"""Prefetch: the loader's batches made in a background thread, a few steps ahead.

`Prefetcher(loader, depth)` runs `loader.next_batch()` in a daemon thread and keeps up to
`depth` batches ready (in pinned host memory where the device supports it, so the copy to the device
can overlap compute), so a training step does not wait for reading, packing or tokenizing
(streaming). Each batch travels with the loader's position and metrics right after it, and
`state_dict()` / `data_metrics()` answer for the batches the trainer has taken, not the ones
made ahead, so checkpoints and resume are exactly as without prefetching.

`data_metrics()` adds the loader's throughput (`data_loader_tokens_per_sec`, tokens made per
second of the thread's busy time: what the loader could feed) and `data_wait_s` (how long the
training loop has waited for batches in all).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

_DONE = object()


class Prefetcher:
    def __init__(self, loader: Any, depth: int = 2, pin: bool = False) -> None:
        assert depth >= 1, depth
        self.loader, self.depth, self.pin = loader, depth, pin
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._state: dict[str, Any] | None = None
        self._metrics: dict[str, float] = {}
        self._busy_s = 0.0
        self._tokens = 0
        self._wait_s = 0.0

    def __getattr__(self, name: str) -> Any:  # seq_len, num_tokens, ...: the loader's
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                start = time.perf_counter()
                batch = self.loader.next_batch()
                if self.pin:
                    batch = {k: v.pin_memory() for k, v in batch.items()}
                item = (batch, self.loader.state_dict(), self.loader.data_metrics())
                self._busy_s += time.perf_counter() - start
                self._tokens += batch["input_ids"].numel()
                self._put(item)
        except BaseException as e:  # re-raised in the training loop, where it can be reported
            self._put((_DONE, e, None))

    def _put(self, item: tuple) -> None:
        """Queue `item`, giving up when the prefetcher is closed (never blocks a shutdown)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="titanite-prefetch", daemon=True)
            self._thread.start()
        start = time.perf_counter()
        batch, state, metrics = self._queue.get()
        self._wait_s += time.perf_counter() - start
        if batch is _DONE:
            raise state
        self._state, self._metrics = state, metrics
        return batch

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch the trainer took."""
        return self._state if self._state is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self._thread is None, "load_state_dict after prefetching started"
        self.loader.load_state_dict(state)

    def data_metrics(self) -> dict[str, float]:
        metrics = self._metrics if self._state is not None else self.loader.data_metrics()
        rate = self._tokens / self._busy_s if self._busy_s > 0 else 0.0
        return {**metrics, "data_loader_tokens_per_sec": rate, "data_wait_s": self._wait_s}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

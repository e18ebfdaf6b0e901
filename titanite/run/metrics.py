"""Metrics: metrics.jsonl (one JSON object per logged step), console progress, and the
experiment trackers (titanite/run/trackers.py: TensorBoard, W&B, MLflow, trackio).

Only rank 0 writes. metrics.jsonl is appended to, so a resumed run continues the same file;
rows at or past the resume step from an interrupted attempt are dropped first, so every step
appears once.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titanite.core.config import Config, MetricsConfig
from titanite.device.peak import Peak, measured_peak
from titanite.run.trackers import Trackers

log = logging.getLogger("titanite")


class MetricsLogger:
    def __init__(self, output_dir: Path, cfg: MetricsConfig, total_steps: int, rank: int = 0) -> None:
        self.cfg, self.total, self.rank = cfg, total_steps, rank
        self.path = output_dir / "metrics.jsonl"
        self.trackers: Trackers | None = None
        mode = cfg.progress_bar
        self.bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.quiet = mode == "off"
        self.started = time.perf_counter()
        self.first_step: int | None = None
        self.output_dir = output_dir

    def start_trackers(self, cfg: Config, resume_step: int) -> None:
        """Start (or, resuming from a checkpoint at `resume_step` > 0, continue) the trackers'
        runs; the package checks ran in preflight."""
        if self.rank == 0:
            self.trackers = Trackers(self.output_dir, cfg, resume_step)

    def truncate_after(self, step: int) -> None:
        """Keep only rows with step <= `step` (the resume point) in metrics.jsonl."""
        if self.rank != 0 or not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def should_log(self, step: int) -> bool:
        return step == 1 or step == self.total or step % self.cfg.log_interval == 0

    def log(self, row: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.trackers is not None:
            self.trackers.log(clean)
        if not self.quiet:
            self._console(row)

    def _console(self, row: dict[str, Any]) -> None:
        step = row["step"]
        if self.first_step is None:
            self.first_step, self.started = step, time.perf_counter()
        done = step - self.first_step
        eta = ""
        if done > 0:
            remaining = (time.perf_counter() - self.started) / done * (self.total - step)
            eta = f" eta {_duration(remaining)}"
        mfu = "n/a" if row.get("mfu") is None else f"{100 * row['mfu']:.1f}%"  # null when above the peak
        text = (f"step {step}/{self.total} loss {row['loss']:.4f} lr {row['lr']:.2e} "
                f"gnorm {row['grad_norm']:.3f} {row['tokens_per_sec']:,.0f} tok/s "
                f"mfu {mfu} mem {_memory(row)}{eta}")
        if self.bar:
            width = 24
            filled = int(width * step / max(1, self.total))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\033[K")
            if step == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            log.info(text)

    def close(self, failed: bool = False) -> None:
        """Finish the trackers' runs (`failed`: the run ends with an error); safe to call twice."""
        if self.trackers is not None:
            self.trackers.close(failed)
            self.trackers = None


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def _memory(row: dict[str, Any]) -> str:
    """The device's peak; "n/a" with the host's where the device keeps no statistics."""
    if "device_peak_alloc_gib" in row and row["device_peak_alloc_gib"] is None:
        return f"n/a (host {row['host_peak_rss_gib']:.1f}GiB)"
    return f"{row.get('mem_gib', 0):.1f}GiB"


class Mfu:
    """Model FLOPs utilisation of `ranks` ranks against the device peak, never above 1: an
    achieved rate above a measured peak means the measurement was disturbed, so it is measured
    again (the larger value kept); above a configured or tabled peak, or still above, the field is
    left empty (null), with a warning."""

    def __init__(self, peak: Peak, flops_per_token: float, ranks: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.peak, self.flops_per_token, self.ranks, self.device, self.dtype = peak, flops_per_token, ranks, device, dtype
        self._remeasured = self._dropped = False

    def __call__(self, tokens_per_sec: float) -> float | None:
        mfu = self.flops_per_token * tokens_per_sec / (self.peak.flops * self.ranks)
        if mfu <= 1.0:
            return mfu
        if self.peak.source.startswith("measured") and not self._remeasured:
            self._remeasured = True
            self.peak = measured_peak(self.device, self.dtype, refresh=True)
            log.warning("achieved FLOP/s exceeded the measured peak: measured again, now %s", self.peak.describe())
            return self(tokens_per_sec)
        if not self._dropped:
            self._dropped = True
            log.warning("achieved %.3g FLOP/s per rank exceeds the device peak %s: mfu is left out (null); set "
                        "metrics.peak_tflops to this device's real peak",
                        self.flops_per_token * tokens_per_sec / self.ranks, self.peak.describe())
        return None


@dataclass
class StepResult:
    """One optimizer step's numbers, as device tensors: read on the host only when logged."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    aux_loss: torch.Tensor | None
    stats: dict[str, torch.Tensor]

    def read(self) -> dict[str, float]:
        """Every number, in one host transfer."""
        named = {"loss": self.loss, "grad_norm": self.grad_norm,
                 **({"aux_loss": self.aux_loss} if self.aux_loss is not None else {}), **self.stats}
        values = torch.stack([torch.as_tensor(v, device=self.loss.device).float() for v in named.values()])
        return dict(zip(named, values.tolist(), strict=True))

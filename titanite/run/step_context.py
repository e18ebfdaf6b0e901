"""What one training step's code needs, as one typed object: the trainer builds it, and the
objectives (titanite/run/lm_step.py, lm_step_pipelined.py, preference/objective.py), the in-loop
benchmarks and the exports read it. None of them sees the trainer."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanite.core.config import Config
from titanite.kernels.reference_ops import IGNORE_INDEX
from titanite.models.handle import ModelHandle, TrainOutput
from titanite.models.lora import dropout_seed
from titanite.parallel import context, distributed
from titanite.parallel.context import ContextParallel
from titanite.parallel.distributed import World
from titanite.parallel.pipeline_runner import Pipeline


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32. logits [B, S, V], labels [B, S] (IGNORE_INDEX skipped)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


@dataclass
class StepContext:
    """The model, where it runs, and how a micro-batch goes through it.

    `accum` is the micro-batches of one optimizer step on this rank; `step` the optimizer steps
    done (the trainer advances it; the dropout seed reads it); `pipeline` is set under pipeline
    parallelism once the stages are built."""

    cfg: Config
    handle: ModelHandle
    world: World
    device: torch.device
    accum: int
    autocast: contextlib.AbstractContextManager
    cp: ContextParallel | None = None
    pipeline: Pipeline | None = None
    step: int = 0

    @property
    def model(self) -> torch.nn.Module:
        return self.handle.module

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def layout(self, batch: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
        """Context parallelism's layout of a split device batch, for its forward and backward."""
        return context.micro_batch(self.cp, batch)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[TrainOutput, torch.Tensor]:
        """The training forward of one device micro-batch (call inside world.loss_parallel()): the
        model's output and the summed fp32 cross-entropy over its valid labels."""
        with self.autocast:
            out = self.handle.forward_train(batch)
        loss_sum = out.loss_sum if out.loss_sum is not None else cross_entropy_sum(out.logits, batch["labels"])
        return out, distributed.full_tensor(loss_sum)

    def seed_dropout(self, micro: int, stage: int | None = None) -> None:
        """Seed LoRA's adapter dropout for micro-batch `micro` (under pipeline parallelism, of the
        stage whose first layer is `stage`): the masks are a function of (seed, step, micro-batch,
        rank, stage), so a resumed run draws the ones the uninterrupted run drew, on any device.
        Nothing happens without adapter dropout."""
        if self.handle.lora is None or self.cfg.lora.dropout <= 0:
            return
        rank = self.world.dp_rank * self.world.cp + (self.cp.rank if self.cp is not None else 0)
        torch.manual_seed(dropout_seed(self.cfg.job.seed, self.step, micro, rank, stage))

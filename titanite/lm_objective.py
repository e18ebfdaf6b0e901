"""The language-model objective's step: the forwards and backwards of one optimizer step's
micro-batches (the preference objective's is titanite/preference/objective.py).

The loss is normalised by the valid label tokens of the whole step (all micro-batches, all
data-parallel and context-parallel ranks), so the summed gradients are those of one batch. A MoE
model adds its load-balancing loss at `model.aux_loss_scope` (titanite/models/moe_balance.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from titanite.kernels import IGNORE_INDEX
from titanite.models.moe_balance import StepBalance
from titanite.parallel import distributed


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32. logits [B, S, V], labels [B, S] (IGNORE_INDEX skipped)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def device_batches(trainer: Any, batches: list[dict[str, torch.Tensor]]
                   ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """The step's micro-batches on the device, and the valid labels of the whole step (all
    micro-batches, all data-parallel and context-parallel ranks) that normalise the loss."""
    world = trainer.world
    batches = [{k: v.to(trainer.device, non_blocking=True) for k, v in b.items()} for b in batches]
    n_valid = torch.stack([(b["labels"] != IGNORE_INDEX).sum() for b in batches]).sum()
    return batches, world.all_reduce_sum_loss(n_valid.to(torch.float32)).clamp_min(1)


def step_balance(trainer: Any) -> StepBalance | None:
    """The step's load-balancing bookkeeping for a MoE model (None for a dense one)."""
    args = trainer.handle.args
    if not getattr(args, "num_experts", 0):
        return None
    w = trainer.world
    return StepBalance(trainer.cfg.model.aux_loss_scope, args.router_aux_loss_coef, bool(args.output_router_logits),
                       trainer.accum, w.dp_size, w.cp, w.all_reduce_sum_dp)


def accumulate(trainer: Any, batches: list[dict[str, torch.Tensor]], seed_dropout: Any
               ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """One step's forwards and backwards on the trainer's model: (the step's loss, the
    load-balancing loss it trained on or None, the metrics), summed over the ranks."""
    world, device = trainer.world, trainer.device
    batches, n_valid = device_batches(trainer, batches)
    balance = step_balance(trainer)
    if balance is not None and balance.counts_first:  # global_batch over several micro-batches
        with torch.no_grad():
            for micro, b in enumerate(batches):
                seed_dropout(micro)
                with world.loss_parallel(), trainer._context(b):
                    balance.add_counts(trainer._forward(b)[0].routing)
        balance.counted()
    total = torch.zeros((), device=device)
    aux_total: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = {}
    for micro, b in enumerate(batches):
        seed_dropout(micro)
        with world.loss_parallel(), trainer._context(b):  # vocab-sharded logits under tensor parallel
            out, loss_sum = trainer._forward(b)
            loss = loss_sum / n_valid
            total = total + loss.detach()
            aux = None
            if balance is not None:  # reported separately, and trained only when the model asks for it
                own = None if out.aux_loss is None else distributed.full_tensor(out.aux_loss)
                aux = balance.term(out.routing, out.stats["moe/load_balance_loss"], own)
            if aux is not None:
                aux_total = aux.detach() if aux_total is None else aux_total + aux.detach()
                loss = loss + aux
            loss.backward()
        for k, v in out.stats.items():
            stats[k] = stats.get(k, 0.0) + v / trainer.accum
    total = world.all_reduce_sum_loss(total)
    if aux_total is not None:
        aux_total = world.all_reduce_sum_loss(aux_total)
    if balance is not None:
        stats |= balance.stats()
    return total, aux_total, stats

"""The language-model objective's step: the forwards and backwards of one optimizer step's
micro-batches (the preference objective's is titanite/run/preference/objective.py).

The loss is normalised by the valid label tokens of the whole step (all micro-batches, all
data-parallel and context-parallel ranks), so the summed gradients are those of one batch. A MoE
model adds its load-balancing loss at `model.aux_loss_scope` (titanite/models/moe_balance.py).
"""

from __future__ import annotations

import torch

from titanite.kernels.reference_ops import IGNORE_INDEX
from titanite.models.moe_balance import StepBalance
from titanite.parallel import context, distributed
from titanite.run.step_context import StepContext

StepOutput = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]


def device_batches(ctx: StepContext, batches: list[dict[str, torch.Tensor]]
                   ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """The step's micro-batches on the device, and the valid labels of the whole step (all
    micro-batches, all data-parallel and context-parallel ranks) that normalise the loss."""
    batches = [ctx.to_device(b) for b in batches]
    n_valid = torch.stack([(b["labels"] != IGNORE_INDEX).sum() for b in batches]).sum()
    return batches, ctx.world.all_reduce_sum_loss(n_valid.to(torch.float32)).clamp_min(1)


def step_balance(ctx: StepContext) -> StepBalance | None:
    """The step's load-balancing bookkeeping for a MoE model (None for a dense one)."""
    args = ctx.handle.args
    if not getattr(args, "num_experts", 0):
        return None
    world = ctx.world
    return StepBalance(ctx.cfg.model.aux_loss_scope, args.router_aux_loss_coef, bool(args.output_router_logits),
                       ctx.accum, world.dp_size, world.cp, world.all_reduce_sum_dp)


def accumulate(ctx: StepContext, batches: list[dict[str, torch.Tensor]]) -> StepOutput:
    """One step's forwards and backwards: (the step's loss, the load-balancing loss it trained on
    or None, the metrics), summed over the ranks."""
    world = ctx.world
    batches, n_valid = device_batches(ctx, batches)
    balance = step_balance(ctx)
    if balance is not None and balance.counts_first:  # global_batch over several micro-batches
        with torch.no_grad():
            for micro, b in enumerate(batches):
                ctx.seed_dropout(micro)
                with world.loss_parallel(), ctx.layout(b):
                    balance.add_counts(ctx.forward(b)[0].routing)
        balance.counted()
    total = torch.zeros((), device=ctx.device)
    aux_total: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = {}
    for micro, b in enumerate(batches):
        ctx.seed_dropout(micro)
        with world.loss_parallel(), ctx.layout(b):  # vocab-sharded logits under tensor parallel
            out, loss_sum = ctx.forward(b)
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
            stats[k] = stats.get(k, 0.0) + v / ctx.accum
    total = world.all_reduce_sum_loss(total)
    if aux_total is not None:
        aux_total = world.all_reduce_sum_loss(aux_total)
    if balance is not None:
        stats |= balance.stats()
    return total, aux_total, stats


def eval_loss(ctx: StepContext, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One held-out (host) batch's summed cross-entropy, of the whole sequences, on every
    context-parallel rank."""
    batch = ctx.to_device(context.split(ctx.cp, batch))
    with ctx.world.loss_parallel(), ctx.layout(batch):
        return ctx.world.all_reduce_sum_cp(ctx.forward(batch)[1].detach())


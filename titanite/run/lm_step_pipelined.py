"""The language-model step under pipeline parallelism (titanite/parallel/pipeline_runner.py), and the
MoE load-balancing loss across pipeline stages.

The step's micro-batches go through the schedule, `parallelism.pp_microbatches` per pass. Each
micro-batch's loss is its summed cross-entropy over the valid labels of the whole step, as
without pipelining.

A MoE model's balancing loss needs, for every micro-batch, the expert counts of layers that run
on other stages: transformers' per-micro-batch loss pools the counts of all layers, and the
global-batch loss pools every micro-batch's. A stage cannot wait for later stages' counts
before its backward, so when the loss is trained a forward-only pass of the step's
micro-batches counts them first (the schedule's own forward, no gradients: a third more compute,
as `model.aux_loss_scope = "global_batch"` with accumulation costs without pipelining). Each stage
then adds its layers' share of the loss to its output: the share's gradient joins the backward
there and nowhere else, and the shares add up to the loss one process computes. The logged
statistics (`moe/*`, both scopes' values) are assembled from every stage's records after the step.
"""

from __future__ import annotations

import torch

from titanite.kernels.routing import RoutingRecord
from titanite.models.moe_balance import StepBalance, global_balance
from titanite.models.moe_stats import load_balancing_loss, pooled, routing_stats
from titanite.models.stage import Part
from titanite.parallel import context, distributed
from titanite.run.lm_step import StepOutput, device_batches
from titanite.run.step_context import StepContext, cross_entropy_sum


class _AddToLoss(torch.autograd.Function):
    """`out` unchanged; in backward the scalar `term` gets gradient 1, as if it were added to the
    loss (a stage's share of the balancing loss, trained through the stage's own backward)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.term_shape = term.shape
        # A copy, not a view: the schedule detaches stage outputs in place after their backward.
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.term_shape, dtype=torch.float32, device=grad.device)


class StageBalance:
    """One step's MoE routing on this rank's stages: its records per micro-batch and layer, the
    counting pass's counts of every stage, and the loss shares the stages add."""

    def __init__(self, ctx: StepContext) -> None:
        arch = ctx.handle.args
        self.ctx, self.handle = ctx, ctx.handle
        self.moe = [i for i in range(arch.num_layers) if arch.layer_is_moe(i)]
        self.slot = {i: n for n, i in enumerate(self.moe)}
        self.experts, self.coef = arch.num_experts, arch.router_aux_loss_coef
        self.trained, self.scope = bool(arch.output_router_logits), ctx.cfg.model.aux_loss_scope
        self.counting = False
        self.reset()

    def reset(self, tokens: int = 0) -> None:
        """A new step; tokens: each micro-batch's (of the whole sequences under cp), which a
        rank whose stages hold no MoE layer needs for the logged values too."""
        M, L, E = self.ctx.accum, len(self.moe), self.experts
        device = self.ctx.device
        self.counts = torch.zeros(M, L, E, device=device)  # this rank's layers; others zero
        self.probs = torch.zeros(M, L, E, device=device)
        self.tokens = tokens
        self.known: torch.Tensor | None = None  # the counting pass's [M, L, E], every stage's layers
        self.global_counts: torch.Tensor | None = None  # [L, E] over the step and the data-parallel ranks
        # the loss share of each micro-batch and stage of this rank (by the stage's first layer)
        self.terms = torch.zeros(M, self.ctx.handle.args.num_layers, device=device)

    def _put(self, into: torch.Tensor, m: torch.Tensor, slots: list[int], values: torch.Tensor) -> None:
        """into[m, slots] = values, with m a [1] device tensor (no host read)."""
        row = into.index_select(0, m)  # [1, L, E]
        row[0, slots] = values
        into.index_copy_(0, m, row)

    def __call__(self, part: Part, out: torch.Tensor, micro: torch.Tensor) -> torch.Tensor:
        m = micro.to(out.device, non_blocking=True)
        records = pooled(self.handle.routing(part.layers))  # over the cp ranks: the whole sequences'
        if not records:
            return out
        slots = [self.slot[i] for i, _ in records]
        counts = torch.stack([r.counts for _, r in records]).float()
        self._put(self.counts, m, slots, counts)
        if self.counting:
            return out
        probs = torch.stack([r.prob_sum for _, r in records])  # [Lp, E], with gradient
        self._put(self.probs, m, slots, probs.detach())
        if not self.trained:
            return out
        L, T = len(self.moe), float(self.tokens)
        if self.scope == "micro_batch":
            f = self.known.index_select(0, m)[0].sum(0) / (T * L)
            world = self.ctx.world
            term = self.coef * self.experts * (f * probs.sum(0) / (T * L)).sum() / (self.ctx.accum * world.dp_size)
        else:
            term = self.coef * global_balance(probs, self.global_counts[slots], self.global_tokens) * len(slots) / L
        term = term / self.ctx.world.cp  # every cp rank holds the whole sequences' records: a 1/cp share each
        # Stored, not added up: the schedule's first forward of a micro-batch may be a shape
        # inference run, which the real one then overwrites.
        self._put(self.terms, m, [part.layers.start], term.detach().view(1))
        return _AddToLoss.apply(out, term)

    def counted(self) -> None:
        """After the counting pass: every stage's counts, and the step's over the data-parallel ranks."""
        world = self.ctx.world
        self.known = world.all_reduce_sum_pp(self.counts.clone())
        self.global_counts = world.all_reduce_sum_dp(self.known.sum(0).clone())
        self.global_tokens = float(self.tokens * self.ctx.accum * world.dp_size)
        self.counts.zero_()

    def finish(self) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """(The trained balancing loss summed over the stages and ranks or None, the step's MoE stats)."""
        world, ctx = self.ctx.world, self.ctx
        packed = world.all_reduce_sum_pp(torch.stack([self.counts, self.probs]))
        stats: dict[str, torch.Tensor] = {}
        report = StepBalance(self.scope, self.coef, False, ctx.accum, world.dp_size, world.cp, world.all_reduce_sum_dp)
        for m in range(ctx.accum):
            records = [(i, RoutingRecord(packed[0, m, n], packed[1, m, n], self.tokens)) for n, i in enumerate(self.moe)]
            balance = load_balancing_loss([r for _, r in records], self.experts)
            report.term([r for _, r in records], balance, None)
            for k, v in routing_stats(records, balance).items():
                stats[k] = stats.get(k, 0.0) + v / ctx.accum
        stats |= report.stats()
        aux = world.all_reduce_sum_loss(world.all_reduce_sum_pp(self.terms.sum())) if self.trained else None
        return aux, stats


def _loss_sum(ctx: StepContext, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's summed cross-entropy: its output itself (the model's loss op), or from
    its logits (a vocabulary-sharded head, under loss_parallel)."""
    if not ctx.handle.loss_from_logits:
        return output
    return distributed.full_tensor(cross_entropy_sum(output, labels))


def around_stage(ctx: StepContext):
    """What runs around each stage's forward: the micro-batch's context-parallel layout, and the
    LoRA dropout seed of (step, micro-batch, rank, stage) so that a resumed run draws the masks
    the uninterrupted one drew."""
    import contextlib

    @contextlib.contextmanager
    def around(part: Part, micro: torch.Tensor, batch: dict[str, torch.Tensor]):
        ctx.seed_dropout(int(micro[0]), part.layers.start)
        with ctx.layout(batch):
            yield

    return around


def stage_hook(ctx: StepContext) -> StageBalance | None:
    """What runs after each stage's forward: a MoE model's StageBalance (None for a dense one)."""
    return StageBalance(ctx) if getattr(ctx.handle.args, "num_experts", 0) else None


def accumulate(ctx: StepContext, batches: list[dict[str, torch.Tensor]]) -> StepOutput:
    """The step's micro-batches through the pipeline: (the step's loss, the trained balancing
    loss or None, the metrics), summed over the ranks. Each stage seeds its own dropout
    (around_stage)."""
    world, pipe = ctx.world, ctx.pipeline
    batches, n_valid = device_batches(ctx, batches)
    balance: StageBalance | None = pipe.on_forward
    n = pipe.layout.microbatches
    passes = range(0, len(batches), n)
    total = torch.zeros((), device=ctx.device)
    with world.loss_parallel(), ctx.autocast:
        if balance is not None:
            balance.reset(batches[0]["input_ids"].numel() * world.cp)
            if balance.trained:  # count every stage's routing first (see the module docstring)
                balance.counting = True
                try:
                    for start in passes:
                        pipe.forward_only(batches[start:start + n], start)
                finally:
                    balance.counting = False
                balance.counted()
        for start in passes:
            total = total + pipe.step(batches[start:start + n],
                                      lambda out, labels: _loss_sum(ctx, out, labels) / n_valid, start)
    total = world.all_reduce_sum_loss(world.all_reduce_sum_pp(total))
    if balance is None:
        return total, None, {}
    aux, stats = balance.finish()
    return total, aux, stats


def eval_loss(ctx: StepContext, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One held-out (host) batch's summed cross-entropy through the pipeline, of the whole
    sequences, on every pipeline and context-parallel rank."""
    world = ctx.world
    batch = ctx.to_device(context.split(ctx.cp, batch))  # this rank's chunks of every sequence under cp
    balance = ctx.pipeline.on_forward
    if balance is not None:
        balance.counting = True  # the records of a forward without gradients: counted, not trained
    try:
        with world.loss_parallel(), ctx.autocast:
            loss = ctx.pipeline.evaluate(batch, lambda out, labels: _loss_sum(ctx, out, labels))
    finally:
        if balance is not None:
            balance.counting = False
    return world.all_reduce_sum_cp(world.all_reduce_sum_pp(loss))

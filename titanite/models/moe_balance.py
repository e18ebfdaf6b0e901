"""The MoE load-balancing loss over one optimizer step, at the scope `model.aux_loss_scope` names.

'micro_batch' (the default) is transformers' loss: each micro-batch on each rank balances its own
tokens (E · Σ_i f_i · P_i, every layer's routing pooled), and the trainer averages those.

'global_batch' is the loss Qwen3's MoE models were trained with (Qiu et al., 2025): per layer,
N_E · Σ_i f_i · p_i where f_i (the share of the tokens routed to expert i; Σ_i f_i = k) counts
every token of the optimizer step, over all micro-batches and data-parallel ranks (and
the cp ranks, whose routing is pooled first), and p_i is the mean router probability over the
same tokens; the layers' losses are averaged, so both scopes equal k at perfect balance and
`router_aux_loss_coef` means the same for both. Only p carries the gradient.

Gradient accumulation is handled exactly. The loss is linear in p once f is known, so each
micro-batch contributes N_E · Σ_i F_i · prob_sum_i / T² (F: the step's counts, T: its tokens,
prob_sum: this micro-batch's summed probabilities), and the contributions add up to the global
loss and its gradient. F must be known before the first micro-batch's backward: with one
micro-batch per step it is all-reduced right after the forward; with more, a no-grad forward of
the step's micro-batches counts it first (one extra forward per micro-batch, about a third more
compute; the dropout masks are seeded as in the real pass, so it counts the same routing).
Activation checkpointing recomputes the routers inside the backward, but nothing is counted
there: the counts come from the forward (or the counting pass) only.

Both scopes' values are logged every logging step: `moe/balance_micro` (the mean of the
micro-batches' losses over the step and the ranks) and `moe/balance_global`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from titanite.kernels.routing import RoutingRecord

Reduce = Callable[[torch.Tensor], torch.Tensor]


def global_balance(prob_sums: torch.Tensor, counts: torch.Tensor, tokens: float) -> torch.Tensor:
    """Mean over layers of N_E · Σ_i (counts_i / T) · (prob_sums_i / T): prob_sums and counts
    [L, E]; the global loss when both cover the whole step, one share of it when prob_sums
    covers one micro-batch (counts: the whole step's)."""
    num_experts = counts.shape[1]
    return num_experts * (counts.float() * prob_sums).sum(1).mean() / (tokens * tokens)


class StepBalance:
    """One step's balance: the loss term each micro-batch adds and both scopes' logged values.

    reduce_dp sums over the data-parallel ranks (records are already pooled over cp); cp: ranks
    holding the same pooled records."""

    def __init__(self, scope: str, coef: float, trained: bool, accum: int, dp: int, cp: int,
                 reduce_dp: Reduce) -> None:
        self.scope, self.coef, self.trained = scope, coef, trained
        self.accum, self.dp, self.cp = accum, dp, cp
        self.reduce_dp = reduce_dp
        self.counts: torch.Tensor | None = None  # the step's [L, E], once known
        self.tokens = 0.0
        self._micro = torch.zeros(())  # summed micro-batch losses (detached)
        self._probs: torch.Tensor | None = None  # summed prob_sums (detached)
        self._seen = torch.zeros(())  # counts seen by the real pass, summed [L, E]
        self._tokens_seen = torch.zeros(())  # and its tokens per layer

    @property
    def counts_first(self) -> bool:
        """Whether the step's counts must come from a counting pass before the real one."""
        return self.scope == "global_batch" and self.trained and self.accum > 1

    def add_counts(self, records: list[RoutingRecord]) -> None:
        """A counting-pass forward's routing (call for every micro-batch, then `counted`)."""
        counts = torch.stack([r.counts for r in records])
        self.counts = counts if self.counts is None else self.counts + counts
        self.tokens += records[0].num_tokens

    def counted(self) -> None:
        self.counts = self.reduce_dp(self.counts.clone())
        self.tokens *= self.dp

    def term(self, records: list[RoutingRecord], micro_balance: torch.Tensor,
             micro_aux: torch.Tensor | None) -> torch.Tensor | None:
        """The loss term one micro-batch adds (scaled by the coefficient; None when the loss is
        not trained). micro_balance: the model's micro-batch balance loss as it logs it
        (moe/load_balance_loss, transformers' math); micro_aux: its trained term (x coef)."""
        counts = torch.stack([r.counts for r in records])
        probs = torch.stack([r.prob_sum for r in records])
        self._micro = self._micro.to(probs.device) + micro_balance
        self._probs = probs.detach() if self._probs is None else self._probs + probs.detach()
        self._seen = self._seen.to(counts.device) + counts
        self._tokens_seen = self._tokens_seen + records[0].num_tokens
        if not self.trained:
            return None
        if self.scope == "micro_batch":
            # The mean over every micro-batch of the global batch: data-parallel gradients are
            # summed, so each rank's share is divided by their count too (cp ranks each hold
            # the whole sequences' value: a 1/cp share each).
            return micro_aux / (self.accum * self.dp * self.cp)
        if self.counts is None:  # one micro-batch per step: its counts are the step's
            self.counts = self.reduce_dp(counts.clone())
            self.tokens = float(records[0].num_tokens * self.dp)
        return self.coef * global_balance(probs, self.counts, self.tokens) / self.cp

    def stats(self) -> dict[str, torch.Tensor]:
        """moe/balance_micro and moe/balance_global of the step (one collective on every rank)."""
        L, E = self._seen.shape
        head = torch.stack([self._micro, self._tokens_seen.to(self._micro.device)])
        packed = self.reduce_dp(torch.cat([head, self._seen.float().flatten(), self._probs.flatten()]))
        counts, probs = packed[2:2 + L * E].view(L, E), packed[2 + L * E:].view(L, E)
        return {"moe/balance_micro": packed[0] / (self.accum * self.dp),
                "moe/balance_global": global_balance(probs, counts, packed[1])}

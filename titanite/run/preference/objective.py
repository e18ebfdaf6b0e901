"""training.objective = 'dpo': one optimizer step over micro-batches of preference pairs.

A micro-batch of B pairs is 2B rows (B chosen, then B rejected; titanite/data/packing.py's
PairWindows). The policy's summed completion log-probs come from its logits; the reference's
from titanite/run/preference/reference.py. Each pair's loss (titanite/run/preference/losses.py) is
divided by the number of pairs in the whole step (every micro-batch on every data-parallel
rank), so the gradient is that of the mean over the global batch, as one batch in TRL; with
sft_weight the chosen completions' token NLL is added, divided by their tokens in the step.
A MoE model's auxiliary loss is added as in language-model training.

The metrics are TRL's: rewards/{chosen,rejected,accuracies,margins} and logps/{chosen,rejected},
means over the step's pairs; evaluation reports them with `eval_` in front.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from titanite.data.loader import PackedLoader
from titanite.evaluation.heldout import Evaluator
from titanite.models.flops import flops_per_token
from titanite.parallel import context, distributed
from titanite.run.lm_step import StepOutput
from titanite.run.preference.losses import PairScores, pair_loss
from titanite.run.preference.reference import (
    Reference,
    adapters_are_reference,
    materialize_reference,
    sequence_logps,
    uses_reference,
    weights_identity,
)
from titanite.run.preflight import Prepared
from titanite.run.step_context import StepContext

log = logging.getLogger("titanite")

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


class PreferenceObjective:
    """The DPO step and evaluation, on the step context's model and world."""

    def __init__(self, ctx: StepContext, reference: Reference | None) -> None:
        self.ctx, self.cfg, self.pr = ctx, ctx.cfg, ctx.cfg.preference
        self.handle, self.world, self.device, self.autocast = ctx.handle, ctx.world, ctx.device, ctx.autocast
        self.reference = reference
        self.cp = ctx.cp

    def reference_flops_per_token(self, seq_len: int) -> float:
        """FLOPs per token of the reference's forward in each step (0 when precomputed or none): a
        third of a full model's training FLOPs, whatever the policy trains (LoRA or all)."""
        if self.reference is None or self.reference.kind == "precomputed":
            return 0.0
        return flops_per_token(self.handle.args, seq_len) / 3

    def accumulate(self, ctx: StepContext, batches: list[dict[str, torch.Tensor]]) -> StepOutput:
        """Forward and backward of every micro-batch of one step: (the step's loss, the MoE
        auxiliary loss or None, the metrics), each summed over the data-parallel ranks."""
        accum, dp, cp = len(batches), self.world.dp_size, self.world.cp
        pairs = float(sum(len(b["pair_index"]) for b in batches) * dp)
        chosen_tokens = None
        if self.pr.sft_weight:  # this rank's chunks' tokens: summed over dp x cp
            n = torch.stack([(b["labels"][: len(b["pair_index"])] != -100).sum() for b in batches]).sum()
            chosen_tokens = self.world.all_reduce_sum_loss(n.to(self.device, torch.float32)).clamp_min(1)
        total = torch.zeros((), device=self.device)
        sums = torch.zeros(len(METRICS), device=self.device)
        aux_total: torch.Tensor | None = None
        stats: dict[str, torch.Tensor] = {}
        for micro, b in enumerate(batches):
            b = {k: v.to(self.device, non_blocking=True) for k, v in b.items()}
            with context.micro_batch(self.cp, b):
                # no loss_parallel: sequence_logps gathers vocabulary-sharded logits itself
                ref = None if self.reference is None else self.reference.logps(b, "train")
                ctx.seed_dropout(micro)  # after the reference's forward, which must not move the masks
                out, scores, chosen_sum = self._scores_with(b, ref)
                result = pair_loss(scores, self.pr)
                loss = result.loss.sum() / pairs
                if chosen_tokens is not None:
                    loss = loss + self.pr.sft_weight * (-chosen_sum.sum() / chosen_tokens)
                # cp ranks compute the same pair losses from the whole rows' sums: a 1/cp share each
                loss = loss / cp
                total = total + loss.detach()
                if out.aux_loss is not None:
                    aux = distributed.full_tensor(out.aux_loss) / (accum * dp * cp)
                    aux_total = aux.detach() if aux_total is None else aux_total + aux.detach()
                    loss = loss + aux
                loss.backward()
            sums += _metric_sums(result)
            for k, v in out.stats.items():
                stats[k] = stats.get(k, 0.0) + v / accum
        total = self.world.all_reduce_sum_loss(total)
        if aux_total is not None:
            aux_total = self.world.all_reduce_sum_loss(aux_total)
        sums = self.world.all_reduce_sum_dp(sums) / pairs
        return total, aux_total, {**dict(zip(METRICS, sums)), **stats}

    def _scores_with(self, b: dict[str, torch.Tensor], ref: Any) -> tuple[Any, PairScores, torch.Tensor]:
        out, logps, tokens = sequence_logps(self.handle, b, self.autocast)
        (pc, pr), (nc, nr) = logps.chunk(2), tokens.chunk(2)
        ref_c, ref_r = ref if ref is not None else (None, None)
        return out, PairScores(pc, pr, nc, nr, ref_c, ref_r), pc

    @torch.no_grad()
    def evaluate(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """The loss (with sft_weight's term, as the training loss) and TRL's metrics over the
        held-out pairs, as eval_<name>. Every rank runs the same number of batches; the pairs past
        the end are left out before the loss, which for 'aot' sorts within the batch."""
        model = self.handle.module
        was_training = model.training
        model.eval()
        # METRICS, then the pair losses, the pairs, the chosen completions' NLL and their tokens
        sums = torch.zeros(len(METRICS) + 4, dtype=torch.float64, device=self.device)
        try:
            for b in batches:
                b = {k: v.to(self.device) for k, v in context.split(self.cp, b).items()}
                valid = b.pop("pair_valid")
                with context.micro_batch(self.cp, b):  # the sums are the whole rows' on every cp rank
                    ref = None if self.reference is None else self.reference.logps(b, "eval")
                    _, scores, chosen_sum = self._scores_with(b, ref)
                result = pair_loss(_select(scores, valid), self.pr)
                sums[:len(METRICS)] += _metric_sums(result).double()
                sums[-4:] += torch.stack([result.loss.sum(), valid.sum(), -chosen_sum[valid].sum(),
                                          scores.chosen_tokens[valid].sum()]).double()
        finally:
            model.train(was_training)
        sums = self.world.all_reduce_sum_dp(sums)
        n = max(float(sums[-3]), 1.0)
        row = {f"eval_{name}": float(v) / n for name, v in zip(METRICS, sums[:len(METRICS)])}
        row["eval_loss"] = float(sums[-4]) / n
        if self.pr.sft_weight:
            row["eval_loss"] += self.pr.sft_weight * float(sums[-2]) / max(float(sums[-1]), 1.0)
        row["eval_pairs"] = int(sums[-3])
        log.info("eval: preference loss %.4f, reward accuracy %.3f over %d pairs", row["eval_loss"],
                 row["eval_rewards/accuracies"], row["eval_pairs"])
        return row


def _select(s: PairScores, keep: torch.Tensor) -> PairScores:
    """The pairs `keep` (bool [B]) of `s`."""
    pick = (lambda t: None if t is None else t[keep])
    return PairScores(*(pick(getattr(s, f.name)) for f in dataclasses.fields(PairScores)))


def _metric_sums(result: Any) -> torch.Tensor:
    """The METRICS of each pair, summed over the batch."""
    c, r = result.chosen_rewards, result.rejected_rewards
    return torch.stack([c, r, (c > r).float(), c - r, result.chosen_logps, result.rejected_logps]).float().sum(1)


def build_objective(ctx: StepContext, ready: Prepared, train: PackedLoader, evaluator: Evaluator | None
                    ) -> PreferenceObjective:
    """The DPO objective with its reference (titanite/run/preference/reference.py): the separate model
    materialised, or the policy with adapters off; for 'precomputed', the tables read or
    computed (training pairs `train.windows`, held-out pairs `evaluator.windows`) and the model
    dropped."""
    cfg, world, device, autocast, cp = ctx.cfg, ctx.world, ctx.device, ctx.autocast, ctx.cp
    reference = None
    if uses_reference(cfg):
        separate = not adapters_are_reference(cfg)
        reference = Reference("model" if separate else "adapters_off", ready.reference if separate else ready.handle,
                              world, autocast, cp)

        def materialize() -> None:
            if separate and not reference.materialized:
                materialize_reference(ready.reference, ready.reference_weights, cfg, world, device)
                reference.materialized = True

        if cfg.preference.reference == "precomputed":
            m = cfg.model
            weights = ready.reference_weights if separate else m.hf_path
            # what decides the reference's numbers: its weights, its resolved config (RoPE scaling
            # included), the backend, device, precision and kernels
            key = {"weights": weights_identity(weights) if weights else ["init", m.spec, m.flavor, m.hf_path,
                                                                          m.init_std, cfg.job.seed],
                   "config": (ready.reference if separate else ready.handle).hf_config(),
                   "adapters_off": not separate, "spec": m.spec, "device": device.type,
                   "precision": cfg.training.mixed_precision, "lora_base": cfg.lora.base_dtype,
                   "kernels": cfg.kernels.select, "plugins": cfg.kernels.plugins}
            size = cfg.training.batch_size
            reference.precompute("train", train.windows, train.store, key, size, device, materialize)
            if evaluator is not None:
                reference.precompute("eval", evaluator.windows, evaluator.store, key,
                                     cfg.eval.batch_size or size, device, materialize)
            reference.kind = "precomputed"
            ready.reference = None  # the last holder of the separate model, so release() frees it
            reference.release()
        else:
            materialize()
    return PreferenceObjective(ctx, reference)

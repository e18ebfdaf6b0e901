"""The per-pair preference losses, as TRL 1.16 defines them (DPOTrainer; 'simpo' as its CPOTrainer).

Every function of a pair sees the policy's and the reference's summed completion log-probs,
and the completion lengths (label tokens) for the length-normalised losses. The loss of a batch
is the mean over its pairs ('aot' and 'aot_unpaired' sort the log-ratios within each
micro-batch, as TRL sorts them within each device's batch); the trainer divides the sum by the number of pairs in the whole
optimizer step instead, so micro-batches and data-parallel ranks add up to the same mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanite.core.config import PreferenceConfig


@dataclass
class PairScores:
    """Per-pair fp32 tensors [B] the loss and the metrics are made from."""

    chosen_logps: torch.Tensor  # policy, summed over the completion's label tokens
    rejected_logps: torch.Tensor
    chosen_tokens: torch.Tensor  # label tokens per completion (>= 1 for a real pair)
    rejected_tokens: torch.Tensor
    ref_chosen_logps: torch.Tensor | None = None  # None for reference-free losses
    ref_rejected_logps: torch.Tensor | None = None


@dataclass
class PairLoss:
    loss: torch.Tensor  # [B], differentiable
    chosen_rewards: torch.Tensor  # [B], detached; TRL's rewards/chosen
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor  # [B], detached; TRL's logps/chosen (mean per token for simpo)
    rejected_logps: torch.Tensor


def pair_loss(s: PairScores, cfg: PreferenceConfig) -> PairLoss:
    """The loss of each pair under `cfg.loss_type`, and what TRL logs about it."""
    beta, kind = cfg.beta, cfg.loss_type
    if kind == "simpo":
        avg_c = s.chosen_logps / s.chosen_tokens.clamp_min(1)
        avg_r = s.rejected_logps / s.rejected_tokens.clamp_min(1)
        z = beta * ((avg_c - avg_r) - cfg.simpo_gamma / beta)
        eps = cfg.label_smoothing
        loss = -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps
        return PairLoss(loss, (beta * avg_c).detach(), (beta * avg_r).detach(), avg_c.detach(), avg_r.detach())
    assert s.ref_chosen_logps is not None and s.ref_rejected_logps is not None, kind
    chosen = s.chosen_logps - s.ref_chosen_logps  # log-ratios against the reference
    rejected = s.rejected_logps - s.ref_rejected_logps
    delta = chosen - rejected
    if kind == "sigmoid":
        loss = -F.logsigmoid(beta * delta)
    elif kind == "hinge":
        loss = torch.relu(1 - beta * delta)
    elif kind in ("ipo", "sigmoid_norm"):  # both normalise each log-ratio by its completion length
        norm = chosen / s.chosen_tokens.clamp_min(1) - rejected / s.rejected_tokens.clamp_min(1)
        loss = (norm - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * norm)
    elif kind == "robust":
        eps = cfg.label_smoothing
        loss = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    elif kind == "exo_pair":
        eps, z = cfg.label_smoothing, beta * delta
        loss = (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    elif kind == "nca_pair":
        loss = (-F.logsigmoid(beta * chosen) - 0.5 * F.logsigmoid(-beta * chosen)
                - 0.5 * F.logsigmoid(-beta * rejected))
    elif kind == "bco_pair":
        loss = -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
    elif kind == "sppo_hard":
        loss = (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    elif kind == "apo_zero":
        loss = (1 - torch.sigmoid(beta * chosen)) + torch.sigmoid(beta * rejected)
    elif kind == "apo_down":
        loss = torch.sigmoid(beta * chosen) + (1 - torch.sigmoid(beta * delta))
    elif kind in ("aot", "aot_unpaired"):  # sorted within the batch: TRL's device batch, titanite's micro-batch
        eps = cfg.label_smoothing
        if kind == "aot":
            pol = (s.chosen_logps - s.rejected_logps).sort(0).values
            ref = (s.ref_chosen_logps - s.ref_rejected_logps).sort(0).values
            z = beta * (pol - ref)
        else:
            z = beta * (chosen.sort(0).values - rejected.sort(0).values)
        loss = -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps
    elif kind == "discopop":
        z = beta * delta
        mix = torch.sigmoid(z / cfg.discopop_tau)
        loss = -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
    else:  # pragma: no cover - config_checks limits loss_type to the names above
        raise AssertionError(kind)
    return PairLoss(loss, (beta * chosen).detach(), (beta * rejected).detach(),
                    s.chosen_logps.detach(), s.rejected_logps.detach())

"""AdamW with parameter groups, and learning-rate schedules as pure functions of the step.

The schedule has no state of its own: the lr at step s is `lr_at(cfg, s)`, so resuming from a
checkpoint's step restores it exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from titanite.core.config import TrainingConfig


def param_groups(model: nn.Module, cfg: TrainingConfig) -> list[dict]:
    """Weight decay on matrices only; norms (1-D) and embeddings are exempt unless configured."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        exempt = p.ndim < 2 or id(p) in embedding_ids
        (no_decay if exempt and not cfg.decay_norms_and_embeddings else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: TrainingConfig) -> torch.optim.Optimizer:
    # fused: one kernel per device and dtype, on CPU and accelerators, DTensor parameters
    # included. Its found_inf input skips a step on the device, which is how the trainer
    # drops a non-finite update without reading the loss on the host.
    return torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=True)


def lr_at(cfg: TrainingConfig, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.lr_schedule == "linear":
        return cfg.lr - (cfg.lr - floor) * progress
    assert cfg.lr_schedule == "wsd", cfg.lr_schedule
    decay_steps = max(1, round(cfg.decay_ratio * cfg.steps))
    decay_start = cfg.steps - decay_steps
    if step < decay_start:
        return cfg.lr
    return cfg.lr - (cfg.lr - floor) * min(1.0, (step - decay_start + 1) / decay_steps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

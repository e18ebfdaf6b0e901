"""`titanite export`: a DCP training checkpoint -> a Hugging Face folder."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from titanite.checkpoint import training_state
from titanite.checkpoint.hf_weights import export_hf
from titanite.config import Config, load_config
from titanite.data.tokenizer import load_tokenizer
from titanite.errors import UserError
from titanite.models.spec import ModelSpec, get_spec

log = logging.getLogger("titanite")


def load_checkpoint_model(checkpoint: Path) -> tuple[Config, ModelSpec, nn.Module]:
    """The run config, its spec, and the model restored on CPU from a checkpoints/step-N folder."""
    config_file = checkpoint / "config.toml"
    if not config_file.is_file():
        raise UserError(f"{checkpoint} has no config.toml: not a titanite checkpoint folder (checkpoints/step-N)")
    cfg = load_config(config_file)
    spec = get_spec(cfg.model.spec)
    model = spec.build(cfg.model)
    model.to_empty(device="cpu")
    spec.init_buffers(model)
    with torch.no_grad():
        training_state.load(checkpoint, model, optimizer=None)
    return cfg, spec, model


def export_checkpoint(checkpoint: Path, out: Path, shard_mb: int) -> Path:
    cfg, spec, model = load_checkpoint_model(checkpoint)
    tokenizer_files = []
    if cfg.data.tokenizer or cfg.model.hf_path:
        tokenizer_files = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path).files
    path = export_hf(spec.hf_state_dict(model), spec.hf_config(model), out, shard_mb,
                     source_folders=[cfg.model.hf_path], tokenizer_files=tokenizer_files)
    log.info("exported %s to %s", checkpoint, path)
    return path

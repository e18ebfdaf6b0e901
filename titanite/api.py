"""Python API: load a Hugging Face folder into a titanite model, and save one back."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from titanite.checkpoint.hf_weights import export_hf
from titanite.config import ModelConfig
from titanite.models.spec import get_spec


def load_pretrained(path: str | Path, spec: str = "qwen3", dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> nn.Module:
    """Build the model described by `path/config.json` with backend `spec` and load its
    safetensors weights. The returned model's `forward(input_ids)` gives logits [B, S, V]."""
    model_spec = get_spec(spec)
    cfg = ModelConfig(spec=spec, hf_path=str(path), init="pretrained")
    model = model_spec.build(cfg)
    model.to_empty(device=device)
    model_spec.load_hf(model, str(path))
    model.to(dtype)
    model_spec.init_buffers(model)
    model.titanite_spec = spec
    model.titanite_source = str(path)
    return model.eval()


def save_pretrained(model: nn.Module, path: str | Path, max_shard_mb: int = 5000) -> Path:
    """Write `model` (from load_pretrained or a trainer) in the Hugging Face layout at `path`,
    with config.json, and generation/tokenizer files from the folder it was loaded from."""
    model_spec = get_spec(getattr(model, "titanite_spec", "qwen3"))
    source = getattr(model, "titanite_source", "")
    return export_hf(model_spec.hf_state_dict(model), model_spec.hf_config(model), path, max_shard_mb,
                     source_folders=[source] if source else [])

"""Python API: load a Hugging Face folder into a titanite model, and save one back."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from titanite.core.config import DEFAULT_SHARD_MB, ModelConfig
from titanite.formats.hf_weights import export_hf
from titanite.models.handle import handle_of
from titanite.models.spec import get_spec
from titanite.parallel.distributed import full_regions


def load_pretrained(path: str | Path, spec: str = "qwen3", dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> nn.Module:
    """Build the model described by `path/config.json` with backend `spec` and load its
    safetensors weights. The returned model's `forward(input_ids)` gives logits [B, S, V]."""
    handle = get_spec(spec).build(ModelConfig(spec=spec, hf_path=str(path), init="pretrained"))
    handle.module.to_empty(device=device)
    handle.load_hf(str(path))
    handle.module.to(dtype)
    handle.init_buffers()
    return handle.module.eval()


def save_pretrained(model: nn.Module, path: str | Path, max_shard_mb: int = DEFAULT_SHARD_MB) -> Path:
    """Write `model` (from load_pretrained, a trainer, or any titanite backend's build) in the
    Hugging Face layout at `path`, with config.json, and generation/tokenizer files from the
    folder it was loaded from. Sharded (DTensor) weights are gathered, one tensor at a time:
    call it on every rank. A LoRA model is written with its adapters merged in (what it computes)."""
    handle = handle_of(model)
    source = [handle.source_folder] if handle.source_folder else []
    return export_hf(handle.hf_state_dict(full_regions, merged=handle.lora is not None), handle.hf_config(), path,
                     max_shard_mb,
                     source_folders=source)

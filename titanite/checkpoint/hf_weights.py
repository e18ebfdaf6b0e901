"""Moving model weights between a materialised model and a Hugging Face folder.

Loading goes tensor by tensor straight into the model's (already allocated) parameters, so a
large model is never held twice. Every expected tensor's name and shape is checked against the
safetensors headers before any data is read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from titanite.checkpoint.safetensors_io import HFReader, write_hf_folder
from titanite.errors import UserError

log = logging.getLogger("titanite")


class StateDictAdapter(Protocol):
    def to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]: ...
    def from_hf(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor: ...
    def ignorable_hf_keys(self) -> set[str]: ...


@torch.no_grad()
def load_with_adapter(model: nn.Module, adapter: StateDictAdapter, folder: str | Path) -> None:
    """Fill every parameter and persistent buffer of `model` from the HF folder."""
    with HFReader(folder) as reader:
        plan = []
        for name, target in model.state_dict().items():
            pairs = adapter.to_hf(name, torch.empty(target.shape, dtype=target.dtype, device="meta"))
            for hf_key, expected in pairs:
                if hf_key not in reader:
                    reader.get(hf_key)  # raises the missing-tensor error (names key and folder)
                reader.check_shape(hf_key, tuple(expected.shape))
            plan.append((name, target, [k for k, _ in pairs]))
        used = {k for _, _, keys in plan for k in keys}
        extra = sorted(set(reader.keys()) - used - adapter.ignorable_hf_keys())
        if extra:
            raise UserError(f"{folder}: checkpoint has tensors this architecture does not use, e.g. "
                            f"'{extra[0]}' in {reader.file_of(extra[0])} ({len(extra)} in all); "
                            f"does config.json match the weights?")
        for name, target, keys in plan:
            value = adapter.from_hf(name, [reader.get(k, dtype=target.dtype) for k in keys])
            target.copy_(value)
    log.info("loaded %d tensors from %s", len(used), folder)


def export_hf(tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any], out: str | Path,
              max_shard_mb: int, source_folders: Iterable[str | Path] = (),
              tokenizer_files: Iterable[Path] = ()) -> Path:
    """Write an HF folder: weights, config.json, generation_config.json and tokenizer files when
    a source folder has them. Atomic (see write_hf_folder)."""
    generation_config = None
    extra = [Path(p) for p in tokenizer_files]
    names = {p.name for p in extra}
    for folder in source_folders:
        if not folder:
            continue
        folder = Path(folder)
        gen = folder / "generation_config.json"
        if generation_config is None and gen.is_file():
            generation_config = json.loads(gen.read_text())
        for fname in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                      "special_tokens_map.json", "added_tokens.json", "chat_template.jinja"):
            if (folder / fname).is_file() and fname not in names:
                extra.append(folder / fname)
                names.add(fname)
    return write_hf_folder(out, tensors, config, max_shard_bytes=max_shard_mb * 10**6,
                           extra_files=extra, generation_config=generation_config)

"""Moving model weights between a materialised model and a Hugging Face folder.

Loading goes tensor by tensor straight into the model's (already allocated, possibly sharded)
parameters, each rank reading only its own slices, so a large model is never held twice. Every expected tensor's name and shape is checked against the
safetensors headers before any data is read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from titanite.core.errors import UserError
from titanite.core.files import inside_folder
from titanite.formats.safetensors_io import HFReader, read_json, write_hf_folder
from titanite.formats.sharded import fill

log = logging.getLogger("titanite")


class StateDictAdapter(Protocol):
    def to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]: ...
    def from_hf(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor: ...
    def ignorable_hf_keys(self) -> set[str]: ...
    def skips(self, name: str) -> bool: ...


def _plan(model: nn.Module, adapter: StateDictAdapter, reader: HFReader,
          whole: bool = True) -> list[tuple[str, torch.Tensor, list[str]]]:
    """(model key, target tensor, HF keys) for every parameter and persistent buffer, after
    checking each HF tensor's presence, shape and kind against the headers (no data read).
    Works on a meta-device model, so it can run before anything is allocated. whole: the model
    is the whole architecture, so the folder must hold no tensor it does not use (False: a
    pipeline stage's part, whose whole model preflight checked)."""
    plan = []
    for name, target in model.state_dict().items():
        if adapter.skips(name):
            continue
        pairs = adapter.to_hf(name, torch.empty(target.shape, dtype=target.dtype, device="meta"))
        for hf_key, expected in pairs:
            if hf_key not in reader:
                reader.get(hf_key)  # raises the missing-tensor error (names key and folder)
            reader.check_shape(hf_key, tuple(expected.shape))
            stored = reader.dtype(hf_key)
            # Same byte size is not the same data: I32 bits read as weights are garbage.
            if target.dtype.is_floating_point and not stored.is_floating_point:
                raise UserError(f"tensor '{hf_key}' in {reader.file_of(hf_key)} is stored as "
                                f"{str(stored).removeprefix('torch.')}, but it is a weight and must be a "
                                "floating-point dtype (F32, BF16, F16); the header is wrong or the file "
                                "is not this model's")
        plan.append((name, target, [k for k, _ in pairs]))
    used = {k for _, _, keys in plan for k in keys}
    extra = sorted(set(reader.keys()) - used - adapter.ignorable_hf_keys())
    if extra and whole:
        raise UserError(f"{reader.folder}: checkpoint has tensors this architecture does not use, e.g. "
                        f"'{extra[0]}' in {reader.file_of(extra[0])} ({len(extra)} in all); "
                        f"does config.json match the weights?")
    return plan


def check_hf_weights(model: nn.Module, adapter: StateDictAdapter, folder: str | Path) -> None:
    """Every check `load_with_adapter` makes before reading data (names, shapes, dtypes, file
    sizes), on a model that may still be on the meta device."""
    with HFReader(folder) as reader:
        _plan(model, adapter, reader)


def load_with_adapter(model: nn.Module, adapter: StateDictAdapter, folder: str | Path, whole: bool = True) -> None:
    """Fill every parameter and persistent buffer of `model` (materialised, sharded or not)
    from the HF folder, after checking every tensor against the headers; a rank reads only the
    slices of the on-disk tensors that fall in its own shards (see sharded.py)."""
    with HFReader(folder) as reader:
        _plan(model, adapter, reader, whole)
        touched = fill(model, adapter, reader)
    log.info("loaded this rank's parts of %d tensors from %s", touched, folder)


def export_hf(tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any], out: str | Path,
              max_shard_mb: int, source_folders: Iterable[str | Path] = (),
              tokenizer_files: Iterable[Path] = ()) -> Path:
    """Write an HF folder: weights, config.json, generation_config.json and tokenizer files when
    a source folder has them. Atomic (see write_hf_folder)."""
    source_folders = [Path(f) for f in source_folders if f]
    generation_config = None
    extra = [Path(p) for p in tokenizer_files]
    names = {p.name for p in extra}
    for folder in source_folders:
        gen = folder / "generation_config.json"
        if generation_config is None and gen.is_file():
            generation_config = read_json(inside_folder(folder, gen.name, f"source folder {folder}"),
                                          "generation config")
        for fname in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                      "special_tokens_map.json", "added_tokens.json", "chat_template.jinja"):
            if (folder / fname).is_file() and fname not in names:
                # Copied into the export: a link out of the folder is refused, not followed.
                extra.append(inside_folder(folder, fname, f"source folder {folder}"))
                names.add(fname)
    layout_source = next((f for f in source_folders if _has_weights(f)), None)
    if layout_source is not None:
        with HFReader(layout_source) as reader:
            multimodal = reader.layout.multimodal
        if multimodal:
            tensors = in_source_layout(tensors, layout_source)
    return write_hf_folder(out, tensors, config, max_shard_bytes=max_shard_mb * 10**6,
                           extra_files=extra, generation_config=generation_config)


def _has_weights(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("*.safetensors"))


def in_source_layout(tensors: Iterable[tuple[str, torch.Tensor]], source: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors under the keys of `source`'s (multimodal) layout, then every
    tensor outside the text model as the source stores it (byte for byte), so the export loads
    as the source's class."""
    with HFReader(source) as reader:
        layout = reader.layout
        for key, tensor in tensors:
            yield layout.to_disk(key), tensor
        for key in reader.passthrough:
            yield key, reader.read_passthrough(key)

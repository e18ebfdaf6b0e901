"""Reading DCP checkpoints without running code from them.

`torch.distributed.checkpoint`'s `FileSystemReader` unpickles the checkpoint's `.metadata`
file with plain `pickle.load`, and its default load planner unpickles byte entries with
`torch.load` unrestricted. Either runs arbitrary code from a crafted checkpoint. titanite reads every
checkpoint through `SafeReader` and `TensorOnlyPlanner` instead:

- `.metadata` is unpickled by `RestrictedUnpickler`, which resolves only the classes DCP metadata
  is made of (the `torch.distributed.checkpoint.metadata` dataclasses, `_StorageInfo`,
  `torch.Size`, dtypes and layouts, paths) and refuses any other global, so no callable an
  attacker names is ever reached;
- every storage entry must name a file inside the checkpoint folder, with no stream transforms;
- byte (pickled) entries are refused: titanite saves tensors only;
- tensors themselves are read by DCP with `torch.load(weights_only=True)`.

`check_compatible` compares the metadata with the state dict about to be filled, so a
checkpoint of another model or layout stops with the first mismatching key and shapes instead
of a collective traceback.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_read_items

from titanite.core.errors import UserError
from titanite.core.files import inside_folder

METADATA_NAME = ".metadata"

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by name; returns nothing else
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpoint(UserError):
    """A checkpoint file asks for something titanite refuses to run or read."""


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any global outside `_ALLOWED` (and the dtype,
    `Size` and layout attributes of `torch`) raises `UnsafeCheckpoint` before it is resolved."""

    def __init__(self, file: io.BufferedIOBase, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, (torch.dtype, torch.layout)):
                return value
        elif name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"{self.where} asks to load '{module}.{name}', which is not part of DCP metadata; "
            "refused: loading it could run code. Only checkpoints written by titanite (or plain "
            "DCP) are read")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"{self.where} holds a persistent reference ({pid!r}); refused")


def read_metadata(folder: str | Path) -> Metadata:
    """The DCP metadata of a checkpoint folder, unpickled safely and checked: every storage
    entry names a file inside `folder` and carries no transforms. UserError otherwise."""
    folder = Path(folder)
    path = folder / METADATA_NAME
    where = f"checkpoint metadata {path}"
    try:
        with open(path, "rb") as f:
            metadata = RestrictedUnpickler(f, where).load()
    except UnsafeCheckpoint:
        raise
    except FileNotFoundError:
        raise UserError(f"{folder} has no {METADATA_NAME}: not a complete DCP checkpoint") from None
    except Exception as e:  # truncated or garbled pickle: any unpickling error
        raise UserError(f"{where} is corrupt: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise UserError(f"{where} does not hold DCP metadata (got {type(metadata).__name__})")
    for index, info in metadata.storage_data.items():
        relative = getattr(info, "relative_path", None)
        inside_folder(folder, relative, f"{where}, entry {getattr(index, 'fqn', index)!r}")
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpoint(f"{where}: entry {index.fqn!r} asks for stream transforms "
                                   f"{info.transform_descriptors}; titanite writes none, refused")
        if not (isinstance(info.offset, int) and isinstance(info.length, int)
                and info.offset >= 0 and info.length >= 0):
            raise UserError(f"{where}: entry {index.fqn!r} has a bad byte range")
    return metadata


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata goes through `read_metadata` (no unpickling of code)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: titanite never writes them
            raise UserError(f"{self.path}: per-rank DCP metadata is not supported")
        metadata = read_metadata(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that byte entries (which it would unpickle with no
    restriction) are refused: this planner never unpickles anything."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise UnsafeCheckpoint(f"checkpoint entry {read_item.dest_index.fqn!r} is pickled bytes, not a "
                               "tensor; titanite saves tensors only and refuses to unpickle it")


class RegionPlanner(TensorOnlyPlanner):
    """Loads boxes of checkpoint tensors: each state-dict value is a plain buffer that says,
    through DCP's chunk-list hook (what a DTensor's local shard uses), which box of the global
    tensor it is; DCP then reads only the stored chunks that overlap it."""

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        self.plan = LoadPlan([item for fqn, obj in self.state_dict.items()
                              for item in _create_read_items(fqn, stored[fqn], obj)])
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


def read_box(folder: str | Path, key: str, starts: list[int], sizes: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The box [starts, starts + sizes) of checkpoint tensor `key`, read through `SafeReader`.
    DCP reads each stored chunk that overlaps it whole (one saving rank's shard at most)."""
    buf = torch.empty(sizes, dtype=dtype)
    buf.__create_chunk_list__ = lambda: [ChunkStorageMetadata(offsets=torch.Size(starts), sizes=torch.Size(sizes))]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: buf}, storage_reader=SafeReader(str(folder)), planner=RegionPlanner(flatten_state_dict=False),
                 no_dist=True)
    del buf.__create_chunk_list__
    return buf


def check_compatible(metadata: Metadata, state: dict[str, Any], folder: str | Path) -> None:
    """Every tensor of `state` (nested dicts, flattened with '.') exists in the checkpoint as a
    tensor with the same global shape and dtype; else a UserError naming the first mismatch.
    DCP reshards across layouts, so only global shapes have to agree."""
    stored = metadata.state_dict_metadata
    for key, value in _flatten(state):
        if not isinstance(value, torch.Tensor):
            continue
        md = stored.get(key)
        shape = tuple(value.shape)
        if md is None:
            near = [k for k in stored if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]][:1]
            hint = f" (it has e.g. '{near[0]}')" if near else ""
            raise UserError(f"checkpoint {folder} has no tensor '{key}' {list(shape)}{hint}: it was "
                            "saved from another model or optimizer setup")
        if isinstance(md, BytesStorageMetadata) or not isinstance(md, TensorStorageMetadata):
            raise UnsafeCheckpoint(f"checkpoint {folder}: '{key}' is stored as pickled bytes, not a "
                                   "tensor; refused")
        if tuple(md.size) != shape:
            raise UserError(f"checkpoint {folder} holds '{key}' with shape {list(md.size)}, but this "
                            f"model needs {list(shape)}: it was saved from another model or layout "
                            "that cannot be resharded into this one")
        if md.properties.dtype != value.dtype:
            raise UserError(f"checkpoint {folder} holds '{key}' as {md.properties.dtype}, but this "
                            f"model needs {value.dtype}")


def _flatten(state: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, leaf) pairs as DCP's flatten_state_dict names them."""
    out: list[tuple[str, Any]] = []
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out

"""Read and write Hugging Face model folders (config.json + safetensors, sharded or not).

Only safetensors is ever loaded: pickle checkpoints (`pytorch_model.bin`) can run code.
Every header is parsed and checked here at open: safetensors' own errors name neither the
file nor the tensor, and a truncated download should fail before any training starts.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from titanite.core.config import DEFAULT_SHARD_MB
from titanite.core.errors import UserError, did_you_mean
from titanite.core.files import fsync_folder, inside_folder
from titanite.formats.layout import layout_of
from titanite.formats.safetensors_stream import _DTYPES, _StreamedShard

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"



def read_hf_config(folder: str | Path) -> dict:
    """The parsed `config.json` of a Hugging Face model folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"checkpoint folder {folder} does not exist or is not a folder")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise UserError(f"checkpoint folder {folder} has no {CONFIG_NAME}")
    return read_json(path, "config")


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`; UserError naming the file (and `what` it is) otherwise."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{what} file {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise UserError(f"{what} file {path} must hold a JSON object, not {type(data).__name__}")
    return data


def read_header(path: Path) -> dict[str, dict]:
    """Parse and check one safetensors header: {key: {"dtype", "shape", "data_offsets"}}.

    Layout: 8-byte little-endian header length N, N bytes of JSON, then the data; offsets are
    relative to the data start, so a complete file is exactly 8 + N + the largest end offset.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"file {path} is truncated: {size} bytes, too short for a header")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise UserError(
                f"file {path} is corrupt or truncated: header length {n} exceeds file size {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"file {path} has a corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise UserError(f"file {path} has a corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for key, info in header.items():
        _check_entry(path, key, info)
        end = max(end, info["data_offsets"][1])
    if size != 8 + n + end:
        state = "truncated" if size < 8 + n + end else "corrupt"
        raise UserError(f"file {path} is {state}: header promises {8 + n + end} bytes, "
                        f"file has {size}")
    return header


def _check_entry(path: Path, key: str, info: object) -> None:
    """One header entry is well formed and its byte span matches its shape and dtype."""
    bad = f"file {path} has a corrupt header entry for tensor '{key}'"
    if not (isinstance(info, dict) and isinstance(info.get("shape"), list)
            and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2):
        raise UserError(f"{bad}: {info!r}")
    start, stop = info["data_offsets"]
    shape = info["shape"]
    if not all(isinstance(v, int) and v >= 0 for v in [start, stop, *shape]) or start > stop:
        raise UserError(f"{bad}: shape {shape}, data_offsets {info['data_offsets']}")
    dtype = getattr(torch, _DTYPES.get(info.get("dtype"), ""), None)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"{bad}: unsupported dtype {info.get('dtype')!r}")
    nbytes = dtype.itemsize * torch.Size(shape).numel()
    if nbytes != stop - start:
        raise UserError(f"{bad}: shape {shape} of {info['dtype']} needs {nbytes} bytes, "
                        f"data_offsets span {stop - start}")


class HFReader:
    """Tensors of a Hugging Face model folder, read one at a time.

    Shards are opened lazily (memory-mapped by safetensors), so reading a model tensor by
    tensor never holds more than one copy of it.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.config = read_hf_config(self.folder)
        self._file: dict[str, Path] = {}          # tensor key -> file holding it
        self._info: dict[str, dict] = {}          # tensor key -> its header entry
        self._handles: dict[Path, object] = {}    # open safe_open handles
        # Same precedence as transformers: a single file wins over an index.
        if (self.folder / SINGLE_NAME).is_file():
            self._add_files([inside_folder(self.folder, SINGLE_NAME, f"checkpoint folder {self.folder}")])
        elif (self.folder / INDEX_NAME).is_file():
            self._add_index(self.folder / INDEX_NAME)
        else:
            files = [inside_folder(self.folder, p.name, f"checkpoint folder {self.folder}")
                     for p in sorted(self.folder.glob("*.safetensors"))]
            if not files:
                raise UserError(
                    f"checkpoint folder {self.folder} has no {SINGLE_NAME}, {INDEX_NAME} or "
                    "*.safetensors file (pickle checkpoints such as pytorch_model.bin are "
                    "not loaded: convert them to safetensors)")
            self._add_files(files)
        self.layout = layout_of(self._file)
        # Multimodal: the text model's tensors under their text-model names; the rest aside.
        self._disk: dict[str, str] = {}  # text-model key -> key on disk, where they differ
        self.passthrough: list[str] = []  # keys on disk outside the text model, sorted
        if self.layout.multimodal:
            self._name_text_model()

    def _name_text_model(self) -> None:
        files, infos = self._file, self._info
        self._file, self._info = {}, {}
        for disk_key in sorted(files):
            key = self.layout.from_disk(disk_key)
            if key is None:
                self.passthrough.append(disk_key)
                continue
            self._file[key], self._info[key] = files[disk_key], infos[disk_key]
            if key != disk_key:
                self._disk[key] = disk_key
        self._passthrough_files = {k: files[k] for k in self.passthrough}

    def read_passthrough(self, disk_key: str) -> torch.Tensor:
        """A tensor outside the text model, as stored (dtype and bytes)."""
        return self._open(self._passthrough_files[disk_key]).get_tensor(disk_key)

    def _add_files(self, files: list[Path]) -> None:
        for path in files:
            for key, info in read_header(path).items():
                if key in self._file:
                    raise UserError(f"tensor '{key}' is in both {self._file[key]} and {path}")
                self._file[key], self._info[key] = path, info

    def _add_index(self, index_path: Path) -> None:
        weight_map = read_json(index_path, "index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"index file {index_path} has no 'weight_map' object")
        headers: dict[str, dict] = {}
        for key, shard in sorted(weight_map.items()):
            # A crafted entry ('../../etc/passwd', an absolute path, a link out) is refused.
            path = inside_folder(self.folder, shard, f"index file {index_path}, tensor '{key}'")
            if shard not in headers:
                if not path.is_file():
                    raise UserError(f"index file {index_path} maps tensor '{key}' to shard "
                                    f"{path}, which does not exist")
                headers[shard] = read_header(path)
            if key not in headers[shard]:
                raise UserError(f"index file {index_path} maps tensor '{key}' to shard {path}, "
                                "which does not contain it")
            self._file[key], self._info[key] = path, headers[shard][key]

    def keys(self) -> list[str]:
        """All tensor keys, sorted."""
        return sorted(self._file)

    def __contains__(self, key: object) -> bool:
        return key in self._file

    def _require(self, key: str) -> None:
        if key not in self._file:
            raise UserError(f"tensor '{key}' is not in checkpoint folder {self.folder}"
                            + did_you_mean(key, self._file))

    def file_of(self, key: str) -> Path:
        """The safetensors file holding `key`."""
        self._require(key)
        return self._file[key]

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of `key` from the header; no data is read."""
        self._require(key)
        return tuple(self._info[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        """Stored dtype of `key` from the header; no data is read."""
        self._require(key)
        return getattr(torch, _DTYPES[self._info[key]["dtype"]])

    def check_shape(self, key: str, expected_shape: Iterable[int]) -> None:
        """Raise a UserError naming tensor, file and both shapes unless they match."""
        expected, found = tuple(expected_shape), self.shape(key)
        if expected != found:
            raise UserError(f"tensor '{key}' in {self._file[key]} has shape {list(found)}, "
                            f"expected {list(expected)}")

    def get(self, key: str, dtype: torch.dtype | None = None,
            device: str | torch.device = "cpu") -> torch.Tensor:
        """Load one tensor (stored shape; stored dtype unless `dtype` is given) onto `device`."""
        return self._read(key, None).to(device=device, dtype=dtype)

    def read(self, key: str, shape: tuple[int, ...], starts: tuple[int, ...], sizes: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
        """The box [starts, starts + sizes) of tensor `key` in `dtype` (a `sharded.Source`):
        safetensors' `get_slice` reads only those bytes of the file."""
        return self._read(key, tuple(slice(a, a + n) for a, n in zip(starts, sizes, strict=True))).to(dtype)

    def _open(self, path: Path):
        try:
            if path not in self._handles:
                self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as e:
            raise UserError(f"cannot open safetensors file {path}: {e}") from e
        return self._handles[path]

    def _read(self, key: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        path = self.file_of(key)
        handle, disk_key = self._open(path), self._disk.get(key, key)
        try:
            return handle.get_tensor(disk_key) if index is None else handle.get_slice(disk_key)[index]
        except SafetensorError as e:
            raise UserError(f"cannot read tensor '{disk_key}' from file {path}: {e}") from e

    def close(self) -> None:
        """Release the open shard handles (and their memory maps)."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> HFReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_hf_folder(out: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], config: dict,
                    max_shard_bytes: int = DEFAULT_SHARD_MB * 10**6, extra_files: Iterable[Path] = (),
                    generation_config: dict | None = None) -> Path:
    """Write a Hugging Face model folder atomically and return its path.

    `tensors` yields (key, tensor) once per key and is consumed shard by shard, so at most one
    shard (`max_shard_bytes`, counted as numel * element size) is held at a time. Tensors keep
    their dtype. The folder is built as a sibling `.tmp-<name>-<pid>` and renamed into place;
    an existing `out` is replaced only once the new folder is complete and fsynced.
    """
    out = Path(out)
    extra = [Path(p) for p in extra_files]
    reserved = {CONFIG_NAME, INDEX_NAME, SINGLE_NAME, "generation_config.json"}
    for path in extra:
        if not path.is_file():
            raise UserError(f"extra file {path} to copy into {out} does not exist")
        if path.name in reserved or path.name.endswith(".safetensors"):
            raise UserError(f"extra file {path} would overwrite the model file {path.name}")
    return write_folder(out, lambda tmp: _write_contents(tmp, tensors, config, max_shard_bytes, extra,
                                                         generation_config))


def write_folder(out: str | Path, fill) -> Path:
    """Build a folder atomically: `fill(tmp)` writes into a sibling `.tmp-<name>-<pid>`, which
    is fsynced and renamed to `out`; an existing `out` is replaced only once the new folder is
    complete. A failure leaves `out` as it was and removes the partial folder."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"output path {out} exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    if tmp.exists():  # left by an earlier crash of a process with our pid
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        fill(tmp)
        fsync_folder(tmp)
        _swap_in(tmp, out)
    finally:
        if tmp.exists():  # a failure before the swap: drop the half-written folder
            shutil.rmtree(tmp)
    return out


def _write_contents(tmp: Path, tensors: Iterable[tuple[str, torch.Tensor]], config: dict,
                    max_shard_bytes: int, extra: list[Path],
                    generation_config: dict | None) -> None:
    weight_map: dict[str, int] = {}    # key -> 0-based shard number
    total_bytes = total_params = 0
    shard: _StreamedShard | None = None
    n_shards = 0
    for key, tensor in tensors:
        assert isinstance(key, str) and key not in weight_map, f"bad or repeated key {key!r}"
        nbytes = tensor.numel() * tensor.element_size()
        if shard is not None and shard.entries and shard.nbytes + nbytes > max_shard_bytes:
            shard.finish()
            shard, n_shards = None, n_shards + 1
        if shard is None:
            shard = _StreamedShard(tmp / f"shard-{n_shards}.part")
        shard.add(key, tensor)
        weight_map[key] = n_shards
        total_bytes += nbytes
        total_params += tensor.numel()
    (shard or _StreamedShard(tmp / "shard-0.part")).finish()
    n_shards += 1

    names = ([SINGLE_NAME] if n_shards == 1 else
             [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)])
    for i, name in enumerate(names):
        os.replace(tmp / f"shard-{i}.part", tmp / name)
    if n_shards > 1:
        index = {"metadata": {"total_parameters": total_params, "total_size": total_bytes},
                 "weight_map": {k: names[weight_map[k]] for k in sorted(weight_map)}}
        _write_json(tmp / INDEX_NAME, index)
    _write_json(tmp / CONFIG_NAME, config)
    if generation_config is not None:
        _write_json(tmp / "generation_config.json", generation_config)
    for path in extra:
        shutil.copyfile(path, tmp / path.name)


def _write_json(path: Path, data: dict) -> None:
    # transformers writes its JSON files with indent 2, sorted keys and a final newline.
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`, replacing any old `out` only after it is aside."""
    aside = out.parent / f".old-{out.name}-{os.getpid()}"
    had_old = out.exists()
    if had_old:
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(out, aside)
    try:
        os.rename(tmp, out)
    except BaseException:
        if had_old:  # put the previous folder back so `out` is never lost
            os.rename(aside, out)
        raise
    fsync_folder(out.parent, files=False)
    if had_old:
        shutil.rmtree(aside)


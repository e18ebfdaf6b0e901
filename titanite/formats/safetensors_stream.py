"""Writing one safetensors file tensor by tensor, byte-equal to safetensors' `save_file`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save as save_bytes

# safetensors dtype tag -> torch dtype name (names resolved lazily: older torch lacks some).
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}
_TAGS = {getattr(torch, name): tag for tag, name in _DTYPES.items() if hasattr(torch, name)}


class _StreamedShard:
    """One safetensors file, written tensor by tensor: what `save_file` writes for the same
    tensors, byte for byte, without holding them all (only the tensor being added).

    Each tensor's bytes go to a scratch file as they arrive; `finish` writes the header, then
    copies the data in the order safetensors itself lays it out. That order (by dtype, then
    name) is taken from the library: `safetensors.torch.save` of one-element stand-ins."""

    _COPY = 64 << 20

    def __init__(self, path: Path) -> None:
        self.path = path
        self.scratch = path.with_suffix(".data")
        self.file = open(self.scratch, "wb")  # noqa: SIM115 (closed by finish)
        self.entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}  # key -> dtype, shape, at, bytes
        self.nbytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
        self.file.write(data)
        n = tensor.numel() * tensor.element_size()
        self.entries[key] = (tensor.dtype, list(tensor.shape), self.nbytes, n)
        self.nbytes += n

    def finish(self) -> None:
        self.file.close()
        order = _library_order({k: e[0] for k, e in self.entries.items()})
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        at = 0
        for key in order:
            dtype, shape, _, n = self.entries[key]
            header[key] = {"dtype": _TAGS[dtype], "shape": shape, "data_offsets": [at, at + n]}
            at += n
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        with open(self.scratch, "rb") as src, open(self.path, "wb") as dst:
            dst.write(len(text).to_bytes(8, "little") + text)
            for key in order:
                _, _, start, n = self.entries[key]
                src.seek(start)
                while n:
                    chunk = src.read(min(n, self._COPY))
                    dst.write(chunk)
                    n -= len(chunk)
        self.scratch.unlink()


def _library_order(dtypes: dict[str, torch.dtype]) -> list[str]:
    """The keys in the order safetensors lays their data out (it sorts them itself)."""
    stand_ins = {k: torch.zeros(1, dtype=d) for k, d in dtypes.items()}
    raw = save_bytes(stand_ins, metadata={"format": "pt"})
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])



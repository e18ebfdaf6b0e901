"""Where Triton kernels run: the device types they compile for, the CPU interpreter for tests,
and why they cannot run on a given device (the registry's `requires` checks)."""

from __future__ import annotations

import importlib.util
import os

import torch

# Where Triton kernels run, as registry device declarations (this layer is below titanite.device,
# which the model layer must not reach): compiled for these device types (ROCm reports "cuda") ...
COMPILED_ON = ("cuda", "xpu")
# ... and, for tests, interpreted on the host CPU under TRITON_INTERPRET=1.
INTERPRETED_ON = ("cpu",)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (read when a kernel module is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreted(device_type: str) -> bool:
    """True when Triton kernels on `device_type` run in the interpreter rather than compiled."""
    return interpreting() and device_type in INTERPRETED_ON


def unavailable(device_type: str, dtype: torch.dtype | None) -> str | None:
    """Why Triton kernels cannot run on this device, or None."""
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed"
    if device_type in INTERPRETED_ON:
        return None if interpreting() else "Triton runs on CPU only under TRITON_INTERPRET=1"
    if device_type not in COMPILED_ON:
        return f"Triton has no backend for device type '{device_type}'"
    return None


def unavailable_dot(device_type: str, dtype: torch.dtype | None) -> str | None:
    """As `unavailable`, for kernels built on tl.dot (wrong on bfloat16 in the interpreter)."""
    why = unavailable(device_type, dtype)
    if why is None and interpreted(device_type) and dtype == torch.bfloat16:
        return "tl.dot on bfloat16 is wrong under TRITON_INTERPRET=1 (use float32/float16 there)"
    return why

"""Triton implementations: fused RMSNorm, fused SwiGLU, and a grouped-GEMM SwiGLU MoE MLP.

Each is a `torch.library` custom op (titanite::*) with a fake (meta) implementation and an
autograd registration whose backward is another Triton custom op, so torch.compile and FSDP
treat them as single opaque ops. The kernel modules import `triton` lazily, on first call.

Where they run: any device Triton has a backend for (CUDA, ROCm, XPU) and, for tests, the CPU
under `TRITON_INTERPRET=1`. The interpreter runs no autotuning (fixed small tiles instead) and
computes `tl.dot` on bfloat16 inputs wrongly, so kernels that use `tl.dot` do not offer
bfloat16 there.
"""

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

"""Device and distributed-backend choice, peak FLOPs and memory statistics.

This is the only module that may name a specific accelerator API; everything else asks here,
so CPU, CUDA and out-of-tree devices (e.g. Trainium's `neuron`) share one code path.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import time

import torch

from titanite.errors import UserError

log = logging.getLogger("titanite")

# Dense bf16 peak TFLOP/s by device-name substring (no sparsity).
_GPU_PEAK_BF16 = {
    "H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0,
    "B200": 2250.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0,
}


def pick_device(name: str) -> torch.device:
    """'auto' -> the accelerator PyTorch reports (cuda, xpu, neuron, ...) else cpu. Under
    torchrun each rank takes its LOCAL_RANK's device index."""
    if name == "auto":
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        name = acc.type if acc is not None else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"config key 'job.device': unknown device '{name}'") from None
    if device.type != "cpu":
        if not torch.accelerator.is_available() or torch.accelerator.current_accelerator().type != device.type:
            raise UserError(f"config key 'job.device': '{name}' is not available on this machine")
        index = int(os.environ.get("LOCAL_RANK", 0)) if device.index is None else device.index
        device = torch.device(device.type, index)
        torch.accelerator.set_device_index(index)
    return device


def dist_backend(device: torch.device) -> str:
    """Process-group backend for the device: gloo on CPU, the device's default elsewhere."""
    if device.type == "cpu":
        return "gloo"
    from torch.distributed import Backend

    backend = Backend.default_device_backend_map.get(device.type)
    if backend is None:
        raise UserError(f"no torch.distributed backend is registered for device '{device.type}'")
    return f"cpu:gloo,{device.type}:{backend}"


def peak_flops(device: torch.device, dtype: torch.dtype, configured_tflops: float = 0.0) -> float:
    """Peak FLOP/s for MFU: configured, else the known-GPU table, else a GEMM measured now."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in _GPU_PEAK_BF16.items():
            if key in name:
                return tflops * 1e12 * (1.0 if dtype == torch.bfloat16 else 0.5)
        log.warning("unknown GPU '%s': measuring its peak with a GEMM; set metrics.peak_tflops", name)
    return measure_gemm_flops(device, dtype)


def measure_gemm_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    """Achieved FLOP/s of an n^3 matmul, a practical peak for devices with no table entry."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    synchronize(device)
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    synchronize(device)
    return 2 * n**3 * iters / (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory in GiB: device peak allocated (accelerators) and process peak RSS (host)."""
    stats = {"host_peak_rss_gib": _peak_rss_bytes() / 2**30}
    if device.type != "cpu":
        stats["device_peak_alloc_gib"] = torch.accelerator.max_memory_allocated(device) / 2**30
        stats["device_reserved_gib"] = torch.accelerator.memory_reserved(device) / 2**30
    return stats


def reset_peak_memory(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)


def _peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024

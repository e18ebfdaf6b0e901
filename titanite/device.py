"""Device and distributed-backend choice, peak FLOPs and memory statistics.

This is the only module that may name a specific accelerator API; everything else asks here,
so CPU, CUDA and out-of-tree devices (e.g. Trainium's `neuron`) share one code path.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s for MFU, and where the number came from (for the log)."""

    flops: float
    source: str

    def describe(self) -> str:
        value = f"{self.flops / 1e12:.1f} TFLOP/s" if self.flops >= 1e12 else f"{self.flops / 1e9:.1f} GFLOP/s"
        return f"{value} ({self.source})"


def peak_flops(device: torch.device, dtype: torch.dtype, configured_tflops: float = 0.0) -> Peak:
    """Peak FLOP/s for MFU: configured, else the known-GPU table, else a short GEMM measured on
    this device (on CPU cached per machine, thread count and dtype; see measured_peak)."""
    if configured_tflops > 0:
        return Peak(configured_tflops * 1e12, "metrics.peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in _GPU_PEAK_BF16.items():
            if key in name:
                return Peak(tflops * 1e12 * (1.0 if dtype == torch.bfloat16 else 0.5), f"{key} table")
        log.warning("unknown GPU '%s': measuring its peak with a GEMM; set metrics.peak_tflops", name)
    return measured_peak(device, dtype)


def measured_peak(device: torch.device, dtype: torch.dtype, refresh: bool = False) -> Peak:
    """The GEMM peak of `device` in `dtype`. On CPU the result is cached in
    `$XDG_CACHE_HOME/titanite/peak_flops.json` (default ~/.cache), keyed by CPU model, thread
    count, torch version and dtype, so later runs start without measuring; `refresh` measures
    again and keeps the larger value."""
    if device.type != "cpu":
        return Peak(measure_gemm_flops(device, dtype), "measured")
    key = f"{_cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}"
    cache = _read_cache()
    if key in cache and not refresh:
        return Peak(float(cache[key]), "measured, cached")
    flops = max(measure_gemm_flops(device, dtype), float(cache.get(key, 0.0)))
    cache[key] = flops
    _write_cache(cache)
    return Peak(flops, "measured")


def measure_gemm_flops(device: torch.device, dtype: torch.dtype, budget_s: float = 0.25) -> float:
    """Achieved FLOP/s of a square matmul, a practical peak for devices with no table entry.

    Bounded in time on every device: the size doubles from 128 while one product takes under
    10 ms (at most 2048), then products of that size repeat for `budget_s`. A CPU without bf16
    matrix units (0.2 GFLOP/s) is measured in well under a second, a fast one at full size."""
    n, seconds = 128, 0.0
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b  # warm-up
        seconds = min(_time_matmul(a, b, 1) for _ in range(3))  # the least disturbed of three
        if seconds > 0.01 or n >= 2048:
            break
        n *= 2
    iters = max(1, min(1000, int(budget_s / max(seconds, 1e-6))))
    return 2 * n**3 * iters / _time_matmul(a, b, iters)


def _time_matmul(a: torch.Tensor, b: torch.Tensor, iters: int) -> float:
    synchronize(a.device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    synchronize(a.device)
    return time.perf_counter() - start


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "titanite" / "peak_flops.json"


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict) -> None:
    path = _cache_file()
    try:  # a cache only: an unwritable home is no reason to stop a run
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        log.debug("could not cache the measured peak in %s: %s", path, e)


def warn_if_slow_bf16(device: torch.device) -> None:
    """bf16 on a CPU whose bf16 matrix products are not clearly faster than fp32 (no bf16 matrix
    units: AVX2-only x86 runs them ~190x slower): say so once, with both numbers."""
    if device.type != "cpu":
        return
    bf16, fp32 = measured_peak(device, torch.bfloat16), measured_peak(device, torch.float32)
    if bf16.flops < 1.5 * fp32.flops:
        log.warning("training.mixed_precision = 'bf16' on this CPU: bf16 matrix products run at %s, fp32 at "
                    "%s, so bf16 trains slower than fp32 here; set training.mixed_precision = 'none'",
                    bf16.describe(), fp32.describe())


def set_host_memory_policy(ranks_on_host: int) -> str:
    """How glibc treats freed host memory in this CPU process; returns the policy applied:
    "keep", "return", or "unchanged" (not Linux with glibc).

    - keep (one process on the host): freed memory stays in the process. By default glibc makes
      every allocation over a threshold its own mmap, unmapped when freed, so a step that
      allocates and frees the same large tensors (logits, activations) faults every page in
      again each step, and the kernel zeroes each one: the demo's step ran 1.3x slower that way
      (docs/performance.md). The heap then keeps some fragmentation above the live tensors.
    - return (several ranks share the host's memory): every allocation from 64 KiB up is its own
      mapping, handed back when freed, and the heap is trimmed from 64 KiB. Under FSDP each
      block's gathers and reduce-scatter buffers otherwise pile up in the heap of every rank: at
      Qwen3-0.6B's shapes on 2 ranks the kept heap outgrew the host, and glibc's own moving
      threshold still held ~1.2 GiB per rank above the live tensors; returned, the resident set
      stays within 2% of `titanite estimate`.

    `TITANITE_KEEP_FREED_MEMORY=1` or `=0` picks keep or return whatever the rank count
    (benchmarks/host_memory.py compares them)."""
    choice = os.environ.get("TITANITE_KEEP_FREED_MEMORY")
    keep = ranks_on_host <= 1 if choice not in ("0", "1") else choice == "1"
    if not sys.platform.startswith("linux"):
        return "unchanged"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "unchanged"
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's malloc.h
    if keep:
        applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    else:  # a fixed threshold also stops glibc raising it as large blocks are freed
        applied = mallopt(M_MMAP_THRESHOLD, 65536) == 1 and mallopt(M_TRIM_THRESHOLD, 65536) == 1
    return ("keep" if keep else "return") if applied else "unchanged"


def total_memory(device: torch.device) -> int:
    """Bytes of memory on `device` (host RAM for the CPU)."""
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return torch.accelerator.get_memory_info(device)[1] if hasattr(torch.accelerator, "get_memory_info") \
        else torch.cuda.get_device_properties(device).total_memory


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

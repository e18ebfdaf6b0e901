"""Peak FLOP/s for MFU: configured, from the named-accelerator table (accelerators.py) by the name
the device reports, or measured with a short GEMM (cached per CPU model, thread count and dtype);
and the warning for bf16 on a CPU without bf16 matrix units.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titanite.device import accelerators
from titanite.device.choice import synchronize

log = logging.getLogger("titanite")


@dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s for MFU, and where the number came from (for the log)."""

    flops: float
    source: str

    def describe(self) -> str:
        value = f"{self.flops / 1e12:.1f} TFLOP/s" if self.flops >= 1e12 else f"{self.flops / 1e9:.1f} GFLOP/s"
        return f"{value} ({self.source})"


def device_name(device: torch.device) -> str | None:
    """The name `device` reports (e.g. "NVIDIA H100 80GB HBM3"), asked of its device module:
    torch.cuda, torch.xpu, or an out-of-tree one such as torch.neuron. None for the CPU and for a
    device module without `get_device_name`."""
    if device.type == "cpu":
        return None
    get_name = getattr(getattr(torch, device.type, None), "get_device_name", None)
    if get_name is None:
        return None
    return get_name() if device.index is None else get_name(device.index)


def peak_flops(device: torch.device, dtype: torch.dtype, configured_tflops: float = 0.0) -> Peak:
    """Peak FLOP/s for MFU: configured, else the named-accelerator table (titanite/device/accelerators.py)
    by the name the device reports, else a short GEMM measured on this device (on CPU cached per
    machine, thread count and dtype; see measured_peak)."""
    if configured_tflops > 0:
        return Peak(configured_tflops * 1e12, "metrics.peak_tflops")
    name = device_name(device)
    if name is not None:
        acc = accelerators.lookup(name)
        tflops = acc.peak_tflops(dtype) if acc is not None else None
        if tflops is not None:
            return Peak(tflops * 1e12, acc.peak_source(dtype))
        log.warning("no %s peak is known for device '%s' (%s): measuring one with a GEMM; set "
                    "metrics.peak_tflops to the device's dense peak", str(dtype).removeprefix("torch."), name, device)
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

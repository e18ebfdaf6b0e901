"""Device and distributed-backend choice, peak FLOPs and memory statistics.

This is the only module that may name a specific accelerator API; everything else asks here,
so CPU, CUDA and out-of-tree devices (e.g. Trainium's `neuron`) share one code path.
"""

from __future__ import annotations

import ctypes
import functools
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

from titanite import accelerators
from titanite.errors import UserError

log = logging.getLogger("titanite")


def pick_device(name: str, source: str = "config key 'job.device'") -> torch.device:
    """'auto' -> the accelerator PyTorch reports (cuda, xpu, neuron, ...) else cpu. Under
    torchrun each rank takes its LOCAL_RANK's device index. Raises UserError, naming `source`
    (where the name came from), for a device type no backend registered, one with no device
    present, and an index past the device count."""
    if name == "auto":
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        name = acc.type if acc is not None else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"{source}: unknown device '{name}': no PyTorch backend registered this "
                        f"device type in this process ({_known_device_types()}); an out-of-tree device's extension "
                        "must be installed and imported (or autoloaded by PyTorch) first") from None
    if device.type == "cpu":
        return device
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != device.type:
        raise UserError(f"{source}: '{name}' is not available on this machine "
                        f"(the accelerator here: {acc.type if acc is not None else 'none'})")
    index = int(os.environ.get("LOCAL_RANK", 0)) if device.index is None else device.index
    count = torch.accelerator.device_count()
    if not 0 <= index < count:
        raise UserError(f"{source}: {device.type}:{index} is not available: this machine has "
                        f"{count} {device.type} device(s)" + (" (torchrun starts one rank per device: "
                        "--nproc_per_node at most the device count)" if device.index is None else ""))
    device = torch.device(device.type, index)
    torch.accelerator.set_device_index(index)
    return device


def _known_device_types() -> str:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return "cpu" + (f" and {acc.type}" if acc is not None else "")


# Process-group backends that take `init_process_group(device_id=...)`, binding the rank to its
# device and connecting eagerly. A plugin backend (a vendor's, or the test device's Python
# ProcessGroup) need not: c10d then fails with "No backend type associated with device type".
_BACKENDS_TAKING_DEVICE_ID = ("nccl", "xccl")


def dist_backend(device: torch.device) -> str:
    """Process-group backend for the device: gloo on CPU; elsewhere gloo for CPU tensors beside
    the backend the device registered (torch.distributed.Backend.default_device_backend_map)."""
    if device.type == "cpu":
        return "gloo"
    from torch.distributed import Backend

    backend = Backend.default_device_backend_map.get(device.type)
    if backend is None:
        raise UserError(f"several ranks on '{device.type}': no torch.distributed backend is registered "
                        f"for device type '{device.type}'; its extension must register one "
                        f"(torch.distributed.Backend.register_backend(name, creator, devices=['{device.type}']))")
    return f"cpu:gloo,{device.type}:{backend}"


def process_group_kwargs(device: torch.device, backend: str) -> dict:
    """Extra init_process_group arguments for `backend` on `device`: `device_id` only for the
    backends known to take it."""
    takes = [b for b in _BACKENDS_TAKING_DEVICE_ID if b in backend.split(",")[-1].split(":")]
    return {"device_id": device} if takes and device.type != "cpu" else {}


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
    """Peak FLOP/s for MFU: configured, else the named-accelerator table (titanite/accelerators.py)
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
    """Bytes of memory on `device` (host RAM for the CPU, and for a device that reports none)."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return torch.accelerator.get_memory_info(device)[1]
    except RuntimeError as e:
        _no_memory_stats(device, e)
        return host


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@functools.cache
def has_memory_stats(device_type: str) -> bool:
    """Whether the device's allocator keeps statistics (torch.accelerator.memory_allocated and
    friends). PyTorch does not require it of a backend: an allocator that is not a caching
    DeviceAllocator has none, and asking fails; the run goes on with host RSS only."""
    if device_type == "cpu":
        return False
    try:
        torch.accelerator.memory_allocated(torch.accelerator.current_device_index())
        return True
    except RuntimeError as e:
        _no_memory_stats(torch.device(device_type), e)
        return False


def _no_memory_stats(device: torch.device, error: Exception) -> None:
    # PyTorch words this as an internal assert; it is the normal answer for such an allocator.
    log.info("%s: its allocator keeps no memory statistics (it is not a caching DeviceAllocator), so device "
             "memory is logged as n/a beside the host's peak RSS", device.type)
    log.debug("torch.accelerator's memory statistics on %s: %s", device.type, " ".join(str(error).split()))


def memory_stats(device: torch.device) -> dict[str, float | None]:
    """Memory in GiB: process peak RSS (host) and, on an accelerator, the device's peak allocated
    and reserved memory: None ("n/a") where its allocator keeps no statistics."""
    stats: dict[str, float | None] = {"host_peak_rss_gib": _peak_rss_bytes() / 2**30}
    if device.type != "cpu":
        known = has_memory_stats(device.type)
        stats["device_peak_alloc_gib"] = torch.accelerator.max_memory_allocated(device) / 2**30 if known else None
        stats["device_reserved_gib"] = torch.accelerator.memory_reserved(device) / 2**30 if known else None
    return stats


def reset_peak_memory(device: torch.device) -> None:
    if has_memory_stats(device.type):
        torch.accelerator.reset_peak_memory_stats(device)


@functools.cache
def has_pinned_memory(device_type: str) -> bool:
    """Whether host memory can be pinned for copies to this device type (the CPU needs none;
    a backend need not provide it: pinning may fail, or give memory that is not pinned).
    Probed once with a one-element tensor."""
    if device_type == "cpu" or not torch.accelerator.is_available():
        return False
    try:
        if torch.empty(1).pin_memory().is_pinned():
            return True
        why = "pinning gives memory that is not pinned"
    except (RuntimeError, NotImplementedError) as e:
        why = " ".join(str(e).split())[:200]
    log.info("%s has no pinned host memory (%s): the data prefetcher copies from pageable memory", device_type, why)
    return False


@functools.cache
def compile_backend(device: torch.device) -> str:
    """torch.compile's backend for `device`: inductor where it has code generation for the device
    type (built in, or registered by the device's extension), else aot_eager (the graph is
    captured and run with the device's own kernels), with a warning."""
    from torch._inductor.codegen.common import get_scheduling_for_device, init_backend_registration

    init_backend_registration()
    if get_scheduling_for_device(device.type) is not None:
        return "inductor"
    log.warning("parallelism.compile: inductor has no code generation for device type '%s'; compiling "
                "with the 'aot_eager' backend instead (graph capture without fused kernels)", device.type)
    return "aot_eager"


def rng_state(device: torch.device) -> torch.Tensor | None:
    """The default generator's state of `device` (None on the CPU: torch.get_rng_state has it)."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device.type).get_rng_state(device)


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    torch.get_device_module(device.type).set_rng_state(state, device)


def _peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


# --- Predicates: what callers outside this module ask instead of comparing device-type strings ---


def is_host(device: torch.device | str) -> bool:
    """True when `device` (a torch.device or a device-type string such as `"cpu"`) is the host CPU:
    no accelerator allocator, no device stream, host RAM and host threads."""
    return (device if isinstance(device, str) else device.type) == "cpu"


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype commands use when none is asked for: float32 on the host CPU (where bf16 matrix
    products can be far slower; see warn_if_slow_bf16), bfloat16 on accelerators."""
    return torch.float32 if is_host(device) else torch.bfloat16

"""Memory of a device and of the host: totals, the allocator's statistics where the device keeps
them (else n/a and host RSS), peak resets, pinned host memory, and how glibc treats freed host memory.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
import sys

import torch

log = logging.getLogger("titanite")


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


def _peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024

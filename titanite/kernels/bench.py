"""`titanite kernels bench`: implementations of each op timed side by side on one device.

Each implementation runs the op's bench case (Qwen3-sized on accelerators, scaled down on CPU;
see `cases.bench_case`), forward alone and forward + backward, after warm-up, as the median of
repeated runs. Accelerators also report the peak memory one forward + backward allocates.
Triton under the CPU interpreter is not timed: those numbers would say nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import titanite.kernels.registry as registry
from titanite.device.choice import is_host, synchronize
from titanite.device.memory import reset_peak_memory
from titanite.kernels.cases import Case, bench_case
from titanite.kernels.triton.availability import interpreted
from titanite.kernels.verify import as_outputs, prepare_args


@dataclass
class BenchRow:
    op: str
    impl: str
    dtype: str
    case: str
    fwd_ms: float | None
    fwd_bwd_ms: float | None
    speedup: float | None  # reference fwd+bwd time / this fwd+bwd time
    peak_mib: float | None
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _step(fn, case: Case, backward: bool) -> None:
    args = prepare_args(case.args, case.grad if backward else (), None)
    with torch.set_grad_enabled(backward):
        outs = [o for o in as_outputs(fn(*args)) if o.is_floating_point() and o.requires_grad]
    if backward and outs:
        # Materialised upstream grads: grouped_mm's backward rejects the stride-0 grad of .sum().
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def _time(fn, case: Case, backward: bool, device: torch.device, min_s: float, max_iters: int) -> float:
    """Median milliseconds of one call, after two warm-up calls."""
    for _ in range(2):
        _step(fn, case, backward)
    synchronize(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_iters and (time.perf_counter() - start < min_s or len(times) < 3):
        t0 = time.perf_counter()
        _step(fn, case, backward)
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak_mib(fn, case: Case, device: torch.device) -> float | None:
    if is_host(device):
        return None
    synchronize(device)
    reset_peak_memory(device)
    base = torch.accelerator.memory_allocated(device)
    _step(fn, case, True)
    synchronize(device)
    return (torch.accelerator.max_memory_allocated(device) - base) / 2**20


def bench(ops: list[str] | None = None, impl: str | None = None, device: torch.device | str = "cpu",
          dtype: torch.dtype = torch.float32, min_s: float = 0.5, max_iters: int = 50,
          progress: Callable[[BenchRow], None] | None = None) -> list[BenchRow]:
    """Time the reference and every other implementation (or the reference and `impl`) of `ops`.
    progress, when given, sees each row as soon as it is done."""
    device = torch.device(device)
    ops = ops or list(registry.OPS)
    rows: list[BenchRow] = []
    for op in ops:
        impls = registry.implementations(op)
        names = [n for n in impls if impl is None or n in (impl, registry.REFERENCE)]
        for case in bench_case(op, dtype, device, big=not is_host(device)):
            ref_ms = None
            for name in names:
                im = impls[name]
                row = BenchRow(op, name, registry.dtype_name(dtype), case.name, None, None, None, None)
                why = im.unavailable(device.type, dtype)
                if why is None and interpreted(device.type) and im.source.startswith("titanite.kernels.triton"):
                    why = "Triton interpreter: not timed"
                if why is not None:
                    row.note = why
                    rows.append(row)
                    if progress:
                        progress(row)
                    continue
                backward = bool(case.grad)
                row.fwd_ms = _time(im.fn, case, False, device, min_s, max_iters)
                row.fwd_bwd_ms = _time(im.fn, case, backward, device, min_s, max_iters) if backward else None
                row.peak_mib = _peak_mib(im.fn, case, device)
                total = row.fwd_bwd_ms or row.fwd_ms
                if name == registry.REFERENCE:
                    ref_ms = total
                row.speedup = ref_ms / total if ref_ms else None
                rows.append(row)
                if progress:
                    progress(row)
    return rows


def format_table(rows: list[BenchRow]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    header = ("op", "impl", "dtype", "case", "fwd ms", "fwd+bwd ms", "vs reference", "peak MiB", "note")
    body = [(r.op, r.impl, r.dtype, r.case, f(r.fwd_ms, ".3f"), f(r.fwd_bwd_ms, ".3f"),
             "-" if r.speedup is None else f"{r.speedup:.2f}x", f(r.peak_mib, ".0f"), r.note) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = [" | ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (header, *body)]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)

"""`titanite kernels verify`: every implementation against its op's reference, forward and backward.

The oracle is the reference run on the same inputs upcast to float64 (float32 where the device
has no float64). An implementation's error is max |impl - oracle| / max |oracle| over its
outputs (forward) and over the input gradients of a fixed random projection of the outputs
(backward). It passes when that error is within twice the error of the reference itself run in
the same dtype, or within a per-dtype floor, whichever is larger: a kernel may not be less
accurate than the plain PyTorch it replaces, beyond rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

import titanite.kernels.registry as registry
from titanite.kernels.cases import Case, verify_cases

# Smallest tolerance per dtype (relative to the output's largest magnitude): a few units of
# rounding, so differences of summation order never fail a kernel.
FLOORS = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Row:
    op: str
    impl: str
    dtype: str
    case: str
    fwd_err: float | None
    bwd_err: float | None
    fwd_tol: float | None
    bwd_tol: float | None
    status: str  # "pass" | "FAIL" | "skip"
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def prepare_args(args: tuple, grad: tuple[int, ...], dtype: torch.dtype | None) -> list:
    """Fresh leaf copies of the float tensors (cast to dtype when given), gradients where asked."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and a.is_floating_point():
            a = a.detach().to(dtype or a.dtype).clone().requires_grad_(i in grad)
        out.append(a)
    return out


def as_outputs(result) -> list[Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _run(fn, case: Case, dtype: torch.dtype | None, projections: list[Tensor] | None):
    """(outputs, input grads) of fn on the case; projections = fixed upstream gradients."""
    args = prepare_args(case.args, case.grad, dtype)
    outs = as_outputs(fn(*args))
    float_outs = [o for o in outs if o.is_floating_point()]
    if projections is None:
        gen = torch.Generator().manual_seed(99)
        projections = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device) for o in float_outs]
    # (y * g).sum() rather than a stride-0 expanded grad: some kernels reject expanded grads.
    terms = [(o.to(p.dtype) * p).sum() for o, p in zip(float_outs, projections) if o.requires_grad]
    total = sum(terms[1:], terms[0]) if terms else None
    grads = []
    if case.grad:
        if total is None:
            raise RuntimeError("no output requires grad: the implementation has no backward")
        leaves = [args[i] for i in case.grad]
        grads = list(torch.autograd.grad(total, leaves, allow_unused=True))
        grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]
    return outs, grads, projections


def _rel_err(got: list[Tensor], want: list[Tensor]) -> float:
    """Largest |got - want| over each tensor's largest |want|. A tensor whose oracle is (near)
    zero, e.g. the q/k gradients of one-token attention, is measured against 1e-2 of the group's
    largest magnitude instead, so rounding noise around zero is not a relative error of 1."""
    group = max((b.double().abs().max().item() for b in want if b.is_floating_point() and b.numel()), default=0.0)
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        if a.shape != b.shape:
            return math.inf
        if not b.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(a, b) else math.inf)
            continue
        if b.numel() == 0:
            continue
        scale = max(b.double().abs().max().item(), 1e-2 * group, 1e-12)
        worst = max(worst, (a.double() - b.double()).abs().max().item() / scale)
    return worst


def _oracle_dtype(device: torch.device) -> torch.dtype:
    try:
        torch.zeros(1, dtype=torch.float64, device=device)
        return torch.float64
    except (RuntimeError, TypeError):
        return torch.float32


def check_case(op: str, impl: registry.Impl, case: Case, dtype: torch.dtype, oracle_dtype: torch.dtype) -> Row:
    ref = registry.reference(op)
    name = registry.dtype_name(dtype)
    want_out, want_grad, proj = _run(ref, case, oracle_dtype, None)
    ref_out, ref_grad, _ = _run(ref, case, dtype, proj)
    fwd_tol = max(FLOORS[dtype], 2 * _rel_err(ref_out, want_out))
    bwd_tol = max(FLOORS[dtype], 2 * _rel_err(ref_grad, want_grad))
    try:
        out, grad, _ = _run(impl.fn, case, dtype, proj)
    except Exception as e:  # a broken kernel is a FAIL row with its error, not a crash of verify
        return Row(op, impl.name, name, case.name, None, None, fwd_tol, bwd_tol, "FAIL", f"{type(e).__name__}: {e}"[:200])
    fwd, bwd = _rel_err(out, want_out), _rel_err(grad, want_grad)
    ok = fwd <= fwd_tol and bwd <= bwd_tol
    note = "" if ok else ("forward" if fwd > fwd_tol else "backward") + " error above tolerance"
    if out and [o.dtype for o in out] != [o.dtype for o in ref_out]:
        ok, note = False, f"output dtypes {[str(o.dtype) for o in out]} differ from the reference's"
    return Row(op, impl.name, name, case.name, fwd, bwd, fwd_tol, bwd_tol, "pass" if ok else "FAIL", note)


def selected(ops: list[str] | None, impl: str | None, dtypes: list[torch.dtype] | None
             ) -> Iterator[tuple[str, str, registry.Impl, torch.dtype]]:
    """(op, implementation name, Impl, dtype) to check: all but the reference, or only `impl`,
    of `ops` (default all), over `dtypes` (default all three). Unknown names raise first."""
    ops = ops or list(registry.OPS)
    for op in ops:
        registry.check_op(op)
    if impl is not None and not any(impl in registry.implementations(op) for op in ops):
        registry.get(ops[0], impl)  # raises, listing what exists
    for op in ops:
        for name, im in registry.implementations(op).items():
            if (impl is None and name == registry.REFERENCE) or (impl is not None and name != impl):
                continue
            for dtype in dtypes or list(DTYPES.values()):
                yield op, name, im, dtype


def skip_row(op: str, name: str, dtype: torch.dtype, case: str, why: str) -> Row:
    return Row(op, name, registry.dtype_name(dtype), case, None, None, None, None, "skip", why)


def verify(ops: list[str] | None = None, impl: str | None = None, device: torch.device | str = "cpu",
           dtypes: list[torch.dtype] | None = None, progress: Callable[[Row], None] | None = None) -> list[Row]:
    """Check implementations (all but the reference, or only `impl`) of `ops` (default all).
    progress, when given, sees each row as soon as it is done."""
    device = torch.device(device)
    oracle = _oracle_dtype(device)
    rows: list[Row] = []
    for op, name, im, dtype in selected(ops, impl, dtypes):
        why = im.unavailable(device.type, dtype)
        if why is not None:
            new = [skip_row(op, name, dtype, "-", why)]
        else:
            new = [check_case(op, im, case, dtype, oracle) for case in verify_cases(op, dtype, device)]
        rows += new
        for row in new if progress else ():
            progress(row)
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.1e}")


def format_table(rows: list[Row]) -> str:
    header = ("op", "impl", "dtype", "case", "fwd err", "bwd err", "fwd tol", "bwd tol", "result")
    body = [(r.op, r.impl, r.dtype, r.case, _fmt(r.fwd_err), _fmt(r.bwd_err), _fmt(r.fwd_tol), _fmt(r.bwd_tol),
             r.status + (f" ({r.note})" if r.note else "")) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = [" | ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (header, *body)]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    passed = sum(r.status == "pass" for r in rows)
    failed = sum(r.status == "FAIL" for r in rows)
    skipped = sum(r.status == "skip" for r in rows)
    lines.append(f"\n{passed} passed, {failed} failed, {skipped} skipped (errors are relative to the largest "
                 f"reference magnitude; tolerance = max(dtype floor, 2 x the reference's own error in that dtype))")
    return "\n".join(lines)

"""`titanite device check`, for someone porting titanite to a device: one line per check (ok, n/a,
FAIL) in the order a port meets them: the device, its c10d backend, the kernels that run on it,
memory statistics, pinned memory, compile, those kernels verified, two AdamW steps of a tiny Qwen3
against the CPU, and with `--nproc N` the collectives through N processes. Exit 0, else 2 on a FAIL."""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from titanite.commands.base import setup_logging
from titanite.core.config import TrainingConfig
from titanite.core.errors import EXIT_USER_ERROR, UserError
from titanite.core.procs import die_with_parent
from titanite.device.choice import (
    compile_backend,
    default_compute_dtype,
    dist_backend,
    is_host,
    pick_device,
    process_group_kwargs,
)
from titanite.device.memory import has_memory_stats, has_pinned_memory
from titanite.device.peak import device_name
from titanite.kernels import iter_kernels, registry
from titanite.kernels.verify import verify
from titanite.models.qwen3.args import Qwen3Args
from titanite.models.qwen3.model import Qwen3
from titanite.run.optim import build_optimizer

log = logging.getLogger("titanite")

OK, NA, FAIL = "ok", "n/a", "FAIL"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TRAIN_STEPS = 2
LOSS_RTOL = 1e-5  # fp32 with the reference kernels on both sides: only summation order may differ
COLLECTIVE_TIMEOUT_S = 120


class Check(NamedTuple):
    status: str  # OK | NA | FAIL
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<5} {self.name}: {self.detail}"


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]


# --- 1-6: what the device offers ------------------------------------------------------------
def device_checks(device: torch.device, dtype: torch.dtype, nproc: int | None) -> list[Check]:
    what = "the host CPU"
    if not is_host(device):
        name = device_name(device)
        what = (f'{device} ("{name}")' if name else str(device)) + f", {torch.accelerator.device_count()} devices"
    default, checked = (registry.dtype_name(d) for d in (default_compute_dtype(device), dtype))
    out = [Check(OK, "device", f"{what}; default compute dtype {default}; checking {checked}")]
    try:
        backend = dist_backend(device)
        extra = process_group_kwargs(device, backend)
        out.append(Check(OK, "c10d backend", backend + (f" (init_process_group gets {', '.join(extra)})" if extra
                                                         else "")))
    except UserError as e:  # without --nproc nothing multi-process was asked: single-process runs go on
        out.append(Check(FAIL if nproc else NA, "c10d backend", str(e)))
    for op in registry.OPS:
        why = {im.name: im.unavailable(device.type, dtype) for im in registry.implementations(op).values()}
        here = ", ".join(name for name, w in why.items() if w is None)
        away = "; ".join(f"{name} ({w})" for name, w in why.items() if w is not None)
        out.append(Check(OK, f"kernels {op}", here + (f"; not here: {away}" if away else "")))
    return out


def runtime_checks(device: torch.device, dtype: torch.dtype, nproc: int | None) -> list[Check]:
    """Memory statistics, pinned host memory and the compile backend."""
    memory = Check(NA, "memory statistics", "the host CPU: host RSS is logged")
    pinned = Check(NA, "pinned host memory", "the host CPU needs none")
    if not is_host(device):
        memory = (Check(OK, memory.name, "peak allocated and reserved device memory are logged")
                  if has_memory_stats(device.type) else
                  Check(NA, memory.name, "the allocator keeps none (runs go on; host RSS is logged)"))
        pinned = Check(NA, pinned.name, "the backend offers none (the data prefetcher copies from pageable memory)")
        if has_pinned_memory(device.type):
            host = torch.arange(4096, dtype=torch.float32).pin_memory()
            same = torch.equal(host.to(device, non_blocking=True).cpu(), host)  # as the prefetcher copies
            pinned = Check(OK if same else FAIL, pinned.name, "pinned, with non_blocking copies to the device"
                           if same else f"a non_blocking copy to {device} came back changed")
    backend = compile_backend(device)
    return [memory, pinned, Check(OK, "compile", "inductor generates code for this device type"
                                  if backend == "inductor" else f"{backend}: inductor has no code generation "
                                  f"for '{device.type}' (graphs are captured, kernels are not fused)")]


# --- 7: kernels verified, as `titanite kernels verify --device` does -------------------------
def verified_checks(device: torch.device, dtype: torch.dtype, nproc: int | None) -> list[Check]:
    groups: dict[tuple[str, str], list] = {}
    for row in verify(device=device, dtypes=[dtype]):  # every implementation but the references
        if row.status != "skip":  # cannot run here: the kernels lines say why
            groups.setdefault((row.op, row.impl), []).append(row)
    if not groups:
        return [Check(NA, "verified", f"only the references run on {device.type} in {registry.dtype_name(dtype)}")]
    out = []
    for (op, impl), rows in groups.items():
        bad = [r for r in rows if r.status == "FAIL"]
        worst = bad[0] if bad else max(rows, key=lambda r: max(r.fwd_err or 0.0, r.bwd_err or 0.0))
        errors = "" if worst.fwd_err is None else (f" (fwd {worst.fwd_err:.1e} tol {worst.fwd_tol:.1e}, bwd "
                                                   f"{worst.bwd_err:.1e} tol {worst.bwd_tol:.1e})")
        detail = (f"{len(bad)} of {len(rows)} cases fail; '{worst.case}': {worst.note}" if bad else
                  f"{len(rows)} cases, forward and backward against the reference; worst '{worst.case}'")
        out.append(Check(FAIL if bad else OK, f"verified {op} {impl}", detail + errors))
    return out


# --- 8: training against the CPU -------------------------------------------------------------
def tiny_model(seed: int = 0) -> nn.Module:
    """A 2-layer native Qwen3 (hidden 64, vocab 512, GQA 4:2, untied), initialised on the CPU from `seed`."""
    args = Qwen3Args(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3(args)
        model.init_weights()
    return model


def train_losses(model: nn.Module, device: torch.device) -> list[float]:
    """Mean token cross-entropy of a copy of `model` on `device` before each of TRAIN_STEPS steps of
    titanite's AdamW and after the last (fp32, one random batch of 2 x 32 tokens). Every call site
    runs the reference: SDPA's fused CPU kernel and a device's math path differ beyond rounding."""
    model = copy.deepcopy(model).to(device=device, dtype=torch.float32)
    for _, _, kernel in iter_kernels(model):
        kernel.bind(registry.get(kernel.op, registry.REFERENCE))
    # Small enough that Adam's first, sign-like update cannot magnify rounding noise in the
    # gradients; large enough that a step not taken shows.
    optimizer = build_optimizer(model, TrainingConfig(lr=1e-3))
    tokens = torch.randint(0, model.args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    losses = []
    for _ in range(TRAIN_STEPS):
        loss = model(inputs, labels=labels) / labels.numel()
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        losses.append((model(inputs, labels=labels) / labels.numel()).item())
    return losses


def compare_training(model: nn.Module, device: torch.device, device_model: nn.Module | None = None) -> list[Check]:
    """train_losses of `device_model` (default: `model`) on `device` against those of `model` on
    the CPU: one line per loss, FAIL where they differ by more than LOSS_RTOL relative."""
    want = train_losses(model, torch.device("cpu"))
    got = train_losses(model if device_model is None else device_model, device)
    names = [f"step {i + 1}" for i in range(TRAIN_STEPS)] + [f"after step {TRAIN_STEPS}"]
    out = []
    for name, g, w in zip(names, got, want, strict=True):
        rel = abs(g - w) / max(abs(w), 1e-12)
        ok = math.isfinite(g) and rel <= LOSS_RTOL
        out.append(Check(OK if ok else FAIL, f"training {name}", f"loss {device} {g:.7f}, cpu {w:.7f}, rel diff "
                         f"{rel:.1e}" + ("" if ok else f" (more than {LOSS_RTOL:.0e})")))
    return out


# --- 9: collectives through N processes ------------------------------------------------------
def _collectives(device: torch.device, rank: int, world: int) -> dict[str, tuple[Callable, object]]:
    """name -> (run it, the known answer): what FSDP2, TP and EP call on device tensors (torch 2.13
    names all_gather_into_tensor and reduce_scatter_tensor all_gather_single and reduce_scatter_single),
    and DCP's object broadcast. Small integers in fp32, so every answer is exact."""

    def ar(n: int, start: float = 0.0) -> torch.Tensor:  # [start, start + 1, ...] on the device
        return torch.arange(n, dtype=torch.float32, device=device) + start

    def into(collective: Callable, out, *inputs):
        collective(out, *inputs)
        return out

    pairs = world * (world - 1) / 2
    sent = {"from": 0, "text": "titanite", "values": [1.5, 2]}
    return {
        "all_reduce": (lambda: into(dist.all_reduce, ar(3, rank)), ar(3) * world + pairs),
        "all_gather_single": (lambda: into(dist.all_gather_single, ar(2 * world, -100), ar(2, 2 * rank)),
                              ar(2 * world)),
        "reduce_scatter_single": (lambda: into(dist.reduce_scatter_single, ar(2, -100), ar(2 * world, 100 * rank)),
                                  ar(2, 2 * rank) * world + 100 * pairs),
        "all_to_all_single": (lambda: into(dist.all_to_all_single, ar(world, -100), ar(world, rank * world)),
                              ar(world) * world + rank),  # element j of every input goes to rank j
        "broadcast_object_list": (lambda: into(lambda objs: dist.broadcast_object_list(objs, src=0),
                                               [sent if rank == 0 else None]), [sent]),
    }


def _wrong(got, want) -> str | None:
    if isinstance(want, torch.Tensor):
        got, want = got.cpu().tolist(), want.cpu().tolist()
    return None if got == want else f"got {got}, want {want}"


def _collective_rank(rank: int, world: int, device_type: str, package: str, workdir: str, parent: int) -> None:
    """One spawned rank: die with `parent` (the command), import the device's package (a spawned
    child has only what PyTorch autoloads), join the group, run each collective, write
    {name: problem or None} to rank<r>.json."""
    die_with_parent(parent)
    importlib.import_module(package)
    results: dict[str, str | None] = {}
    try:
        device = torch.device("cpu") if is_host(device_type) else pick_device(f"{device_type}:{rank}")
        backend = dist_backend(device)
        dist.init_process_group(backend, init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S / 2),
                                **process_group_kwargs(device, backend))
        results["process group"] = None
        for name, (run, want) in _collectives(device, rank, world).items():
            try:
                results[name] = _wrong(run(), want)
            except Exception as e:  # a collective the backend lacks: its line names the error
                results[name] = _err(e)
        dist.destroy_process_group()
    except Exception as e:
        results["process group"] = _err(e)
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(results))


def collective_checks(device: torch.device, dtype: torch.dtype, nproc: int | None) -> list[Check]:
    if not nproc:
        return []
    try:
        backend = dist_backend(device)
    except UserError:
        return [Check(FAIL, "collectives", f"not run: no c10d backend for '{device.type}' (see above)")]
    # Built-in devices live in torch; an out-of-tree one in the package that registered its module.
    package = "torch" if is_host(device) else torch.get_device_module(device.type).__name__.split(".")[0]
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="titanite-device-check-") as workdir:
        procs = [ctx.Process(target=_collective_rank, args=(r, nproc, device.type, package, workdir, os.getpid()))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():  # a rank stuck in a collective its peers never joined
                p.kill()
                p.join()
        reports = [json.loads(f.read_text()) if (f := Path(workdir, f"rank{r}.json")).exists() else None
                   for r in range(nproc)]
    out = []
    for name in ["process group", *_collectives(torch.device("cpu"), 0, nproc)]:
        problems = [f"rank {r}: no report (exit code {p.exitcode}; ranks still running after "
                    f"{COLLECTIVE_TIMEOUT_S} s are killed)" if rep is None else
                    f"rank {r}: {rep.get(name, 'not run')}" for r, (p, rep) in enumerate(zip(procs, reports))
                    if rep is None or rep.get(name, "not run") is not None]
        detail = f"{nproc} ranks, {backend}" if name == "process group" else f"{nproc} ranks, known answer"
        out.append(Check(FAIL, name, problems[0]) if problems else Check(OK, name, detail))
    return out


# --- the command -----------------------------------------------------------------------------
STAGES = {"device": device_checks, "runtime": runtime_checks, "verified": verified_checks,
          "training": lambda device, dtype, nproc: compare_training(tiny_model(), device),
          "collectives": collective_checks}


def run_checks(device: torch.device, dtype: torch.dtype, nproc: int | None) -> Iterator[Check]:
    """Every check in order. A stage that raises is a FAIL line naming the error (the traceback
    goes to the log): what a port lacks is the finding, not a crash of the command."""
    for name, stage in STAGES.items():
        try:
            yield from stage(device, dtype, nproc)
        except Exception as e:
            log.error("device check '%s' raised:", name, exc_info=True)
            yield Check(FAIL, name, _err(e))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titanite device", description="check: is this device ready for titanite?")
    parser.add_argument("action", choices=("check",))
    parser.add_argument("--device", default="auto", help="'auto' (the accelerator, else cpu), 'cpu', 'cuda', ...")
    parser.add_argument("--nproc", type=int, help="also run the collectives through this many processes")
    parser.add_argument("--dtype", choices=list(DTYPES), help="dtype of the kernel checks (default: bfloat16 on "
                        "accelerators, float32 on CPU); the training check is always float32")
    args = parser.parse_args(argv)
    setup_logging()
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    device = pick_device(args.device, "--device")
    if args.nproc and not is_host(device) and args.nproc > (count := torch.accelerator.device_count()):
        raise UserError(f"--nproc {args.nproc}: this machine has {count} {device.type} device(s), and the "
                        "collective check runs one process per device")
    dtype = DTYPES[args.dtype] if args.dtype else default_compute_dtype(device)
    checks = []
    for check in run_checks(device, dtype, args.nproc):
        print(check.line(), flush=True)
        checks.append(check)
    n = {s: sum(c.status == s for c in checks) for s in (OK, NA, FAIL)}
    print(f"\n{device}: {n[OK]} ok, {n[NA]} n/a, {n[FAIL]} FAIL: {'NOT ready' if n[FAIL] else 'ready'} for titanite")
    return EXIT_USER_ERROR if n[FAIL] else 0

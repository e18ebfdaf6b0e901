"""`titanite kernels list | verify | bench`: what is registered, is it right, is it fast.

Plugins come from `--plugins` and from `--config FILE`'s `kernels.plugins` (and, always, from
the `titanite.kernels` entry-point group), so a user checks their own kernel with the command
that checks the built-in ones. `verify` exits 1 when any implementation fails. `verify --spec`
runs through a model's call sites (`models/call_sites.py`, which builds the models).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import titanite.kernels.registry as registry
from titanite.commands.base import setup_logging
from titanite.core.errors import UserError
from titanite.device.choice import default_compute_dtype, pick_device
from titanite.kernels.plugins import load_plugins
from titanite.models.call_sites import verify_call_sites

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plugins", nargs="*", default=[], metavar="MODULE",
                        help="kernel plugin modules (dotted names, or paths to a .py file or package folder)")
    parser.add_argument("--config", help="a run config: its kernels.plugins are loaded too")
    parser.add_argument("--device", default="auto", help="'auto' (the accelerator, else cpu), 'cpu', 'cuda', ...")


def _setup(args: argparse.Namespace) -> torch.device:
    plugins = list(args.plugins)
    if args.config:
        from titanite.core.config import load_config

        plugins = load_config(args.config).kernels.plugins + plugins
    load_plugins(plugins)
    return pick_device(args.device, "--device")


def _ops(op: str | None) -> list[str] | None:
    if op is None:
        return None
    registry.check_op(op)
    return [op]


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise UserError(f"unknown dtype '{name}'; choose from {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _write_json(path: str | None, rows) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps([r.as_dict() for r in rows], indent=1))


def _progress(row) -> None:
    """One line per finished row on stderr, so a run cut short still shows how far it got."""
    print(f"  {row.op} {row.impl} {row.dtype} {row.case}: {row.status} {row.note}".rstrip(), file=sys.stderr,
          flush=True)


def run_list(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titanite kernels list", description="List ops and their implementations.")
    _common(parser)
    args = parser.parse_args(argv)
    device = _setup(args)
    for op, (_, summary) in registry.OPS.items():
        sig = str(registry.signature(op)).replace("'", "")
        print(f"{op}{sig}\n    {summary}")
        for name, im in registry.implementations(op).items():
            devs = ",".join(im.devices) if im.devices else "any device"
            dts = ",".join(registry.dtype_name(d) for d in im.dtypes) if im.dtypes else "any dtype"
            why = im.unavailable(device.type)
            here = f"runs on {device.type}" if why is None else f"not on {device.type}: {why}"
            print(f"    {name:<12} {devs:<14} {dts:<28} {here}  [{im.source}]")
    return 0


def run_verify(argv: list[str]) -> int:
    from titanite.kernels.verify import format_table, verify

    parser = argparse.ArgumentParser(prog="titanite kernels verify",
                                     description="Check implementations against the reference, forward and backward.")
    parser.add_argument("op", nargs="?", help="one op (default: all)")
    parser.add_argument("--impl", help="only this implementation (default: all but the reference)")
    parser.add_argument("--dtype", nargs="*", choices=list(_DTYPES), help="dtypes (default: all three)")
    parser.add_argument("--spec", choices=("hf", "qwen3"),
                        help="run each implementation through this backend's model call sites (one training "
                             "forward and backward of a small MoE) instead of on the op's own test cases")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    _common(parser)
    args = parser.parse_args(argv)
    device = _setup(args)
    dtypes = [_dtype(d) for d in args.dtype] if args.dtype else None
    if args.spec:
        rows = verify_call_sites(args.spec, _ops(args.op), args.impl, device, dtypes, progress=_progress)
    else:
        rows = verify(_ops(args.op), args.impl, device, dtypes, progress=_progress)
    where = f" through the {args.spec} model's call sites" if args.spec else ""
    print(f"titanite kernels verify on {device}{where}\n")
    print(format_table(rows))
    _write_json(args.json, rows)
    return 1 if any(r.status == "FAIL" for r in rows) else 0


def run_bench(argv: list[str]) -> int:
    from titanite.kernels.bench import bench, format_table

    parser = argparse.ArgumentParser(prog="titanite kernels bench", description="Time implementations side by side.")
    parser.add_argument("op", nargs="?", help="one op (default: all)")
    parser.add_argument("--impl", help="only the reference and this implementation")
    parser.add_argument("--dtype", default=None, choices=list(_DTYPES),
                        help="compute dtype (default: bfloat16 on accelerators, float32 on CPU)")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="time each measurement at least this long")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    _common(parser)
    args = parser.parse_args(argv)
    device = _setup(args)
    dtype = _dtype(args.dtype) if args.dtype else default_compute_dtype(device)
    rows = bench(_ops(args.op), args.impl, device, dtype, min_s=args.min_seconds,
                 progress=lambda r: print(f"  {r.op} {r.impl} {r.case}: {r.fwd_bwd_ms or r.fwd_ms or r.note}",
                                          file=sys.stderr, flush=True))
    print(f"titanite kernels bench on {device}, {registry.dtype_name(dtype)}\n")
    print(format_table(rows))
    _write_json(args.json, rows)
    return 0


def main(argv: list[str]) -> int:
    """`titanite kernels ARGV`."""
    setup_logging()
    subcommands = {"list": run_list, "verify": run_verify,
                   "bench": run_bench}
    if not argv or argv[0] not in subcommands:
        print("usage: titanite kernels {list|verify|bench} [OP] [--impl NAME] [--plugins MODULE ...] "
              "[--config FILE] [--device D]")
        if argv and argv[0] not in ("-h", "--help"):
            raise UserError(f"unknown kernels subcommand '{argv[0]}'; choose from {', '.join(subcommands)}")
        return 0
    return subcommands[argv[0]](argv[1:])

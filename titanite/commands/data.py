"""`titanite data prepare --config FILE [--workers N] [--out DIR]` and `titanite data verify DIR`:
tokenize a config's data once into token stores, and check a store against its manifest."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from titanite.commands.base import setup_logging
from titanite.core.errors import UserError
from titanite.data import prepare, store


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titanite data",
        description="prepare: tokenize a config's [data] (and eval.path) once into token stores, in "
                    "parallel; training memory-maps them. By default they go to data.cache_dir, where "
                    "every later run of the same source and tokenizer finds them; with --out, to that "
                    "folder (point data.path at it). verify DIR: re-hash a store's files against its "
                    "manifest. Exit 0 when done / intact, 2 otherwise.",
        epilog="Overrides: --section.key=value, as for titanite train.")
    parser.add_argument("action", choices=("prepare", "verify"))
    parser.add_argument("dir", nargs="?", help="verify: the store folder")
    parser.add_argument("--config", help="prepare: the TOML config whose [data] to tokenize")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) // 2),
                        help="prepare: tokenizer processes (default: half the CPUs)")
    parser.add_argument("--out", help="prepare: write the [data] store to this folder instead of the cache")
    args, overrides = parser.parse_known_args(argv)
    setup_logging()
    if args.action == "verify":
        if not args.dir:
            raise UserError("titanite data verify needs the store folder: titanite data verify DIR")
        store.verify_store(Path(args.dir))
        print(f"{args.dir}: intact")
        return 0
    if overrides and not all(o.startswith("--") for o in overrides):
        raise UserError(f"titanite data prepare: unexpected arguments {overrides}")
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    from titanite.core.config import load_config
    from titanite.data.mixture import run_data_configs
    from titanite.data.tokenizer import load_tokenizer
    from titanite.run.preflight import check_input_paths

    cfg = load_config(args.config, overrides)
    check_input_paths(cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    if cfg.data.sources and args.out:
        raise UserError("--out names one store, but data.sources is a mixture: prepare into data.cache_dir "
                        "(leave out --out), where training finds every source's store")
    for what, data in run_data_configs(cfg):
        out = Path(args.out) if args.out and what == "data.path" else None
        if out:
            with prepare.locked_destination(out):
                made = prepare.prepare(data, tokenizer, out, args.workers)
        else:
            made = prepare.obtain(data, tokenizer, args.workers)
        print(f"{what}: {made.path} ({made.num_samples} samples, {made.num_tokens} tokens, largest id {made.max_id})")
    return 0

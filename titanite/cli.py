"""The `titanite` command: train | export | (more subcommands register here)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from titanite.errors import EXIT_DIVERGED, EXIT_USER_ERROR, TrainingDiverged, UserError

log = logging.getLogger("titanite")


def setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 or os.environ.get("TITANITE_LOG_ALL_RANKS") else logging.WARNING
    prefix = f"[titanite r{rank}]" if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1" else "[titanite]"
    logging.basicConfig(level=level, format=f"{prefix} %(message)s", stream=sys.stderr, force=True)


def _user_errors(fn):
    """Run fn; a UserError becomes one message and exit 2, divergence exit 3."""
    def wrapped(*a, **kw) -> int:
        try:
            return fn(*a, **kw) or 0
        except UserError as e:
            print(f"titanite: error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
        except TrainingDiverged as e:
            print(f"titanite: training diverged: {e}", file=sys.stderr)
            return EXIT_DIVERGED
    return wrapped


@_user_errors
def run_train(argv: list[str]) -> int:
    from titanite.config import help_text, load_config

    parser = argparse.ArgumentParser(prog="titanite train", description="Train a Qwen3 model.",
                                     epilog="Overrides: --section.key=value (see --help-config).")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--help-config", action="store_true", help="list every config key and exit")
    args, overrides = parser.parse_known_args(argv)
    if args.help_config:
        print(help_text())
        return 0
    setup_logging()
    cfg = load_config(args.config, overrides)
    from titanite.trainer import Trainer

    Trainer(cfg).train()
    return 0


@_user_errors
def run_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titanite export",
                                     description="Turn a training checkpoint into a Hugging Face folder.")
    parser.add_argument("--checkpoint", required=True, help="a checkpoints/step-N folder")
    parser.add_argument("--out", required=True, help="output folder (replaced atomically)")
    parser.add_argument("--shard-mb", type=int, default=5000, help="largest safetensors shard, MB")
    args = parser.parse_args(argv)
    setup_logging()
    from titanite.export import export_checkpoint

    export_checkpoint(Path(args.checkpoint), Path(args.out), args.shard_mb)
    return 0


COMMANDS = {"train": run_train, "export": run_export}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: titanite {{{'|'.join(COMMANDS)}}} ...", file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"titanite: error: unknown command '{argv[0]}'", file=sys.stderr)
            return EXIT_USER_ERROR
        return 0
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())

"""`titanite train --config FILE [--section.key=value ...]` (also `python -m titanite.train`, under
torchrun or not)."""

from __future__ import annotations

import argparse

from titanite.commands.base import setup_logging
from titanite.core.config import help_text, load_config


def main(argv: list[str]) -> int:
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
    from titanite.run.trainer import Trainer

    Trainer(cfg).train()
    return 0

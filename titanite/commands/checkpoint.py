"""`titanite checkpoint verify DIR`: a training checkpoint (or every one of a run) against its
manifest."""

from __future__ import annotations

import argparse
from pathlib import Path

from titanite.checkpoint.training_state import verify_command
from titanite.commands.base import setup_logging


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titanite checkpoint",
        description="verify DIR: check a training checkpoint (checkpoints/step-N), or every checkpoint of a "
                    "run folder or checkpoints/ folder, against its manifest (sizes and SHA-256), and read "
                    "its DCP metadata safely. Exit 0 when all are intact, 2 otherwise.")
    parser.add_argument("action", choices=("verify",))
    parser.add_argument("dir", help="checkpoints/step-N, checkpoints/, or a run's output_dir")
    args = parser.parse_args(argv)
    setup_logging()
    return verify_command(Path(args.dir))

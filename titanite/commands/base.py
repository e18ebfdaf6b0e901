"""What every command shares: logging set up per rank, and the exit codes of the contract (a
`UserError` or a storage fault is one message and exit 2, divergence exit 3)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from titanite.core.errors import EXIT_DIVERGED, EXIT_USER_ERROR, TrainingDiverged, UserError
from titanite.core.files import STORAGE_ERRNOS, storage_error

log = logging.getLogger("titanite")


def setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 or os.environ.get("TITANITE_LOG_ALL_RANKS") else logging.WARNING
    prefix = f"[titanite r{rank}]" if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1" else "[titanite]"
    logging.basicConfig(level=level, format=f"{prefix} %(message)s", stream=sys.stderr, force=True)


def run_command(main: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """`main(argv)`'s exit code; a UserError or a storage fault (full disk, read-only folder)
    becomes one message and exit 2, divergence exit 3."""
    try:
        return main(argv) or 0
    except UserError as e:
        print(f"titanite: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS:
            raise
        print(f"titanite: error: {storage_error(e, 'writing the run')}", file=sys.stderr)
        return EXIT_USER_ERROR
    except TrainingDiverged as e:
        print(f"titanite: training diverged: {e}", file=sys.stderr)
        return EXIT_DIVERGED

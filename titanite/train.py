"""`python -m titanite.train --config FILE [--section.key=value ...]` (also under torchrun)."""

from __future__ import annotations

import sys

from titanite.cli import run


def main(argv: list[str] | None = None) -> int:
    return run("train", sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    from titanite.parallel.distributed import exit_process

    exit_process(main())

"""The `titanite` command: `titanite COMMAND ...` runs `titanite.commands.COMMAND.main`.

Commands: train, export, checkpoint, generate, eval, kernels, plot, estimate, data, device. Each
is one module under titanite/commands/, imported only when it runs.
"""

from __future__ import annotations

import importlib
import sys

from titanite.commands.base import run_command
from titanite.core.errors import EXIT_USER_ERROR

COMMANDS = ("train", "export", "checkpoint", "generate", "eval", "kernels", "plot", "estimate", "data", "device")


def run(command: str, argv: list[str]) -> int:
    """`titanite COMMAND ARGV`'s exit code (0, 2 for a user error, 3 for divergence)."""
    return run_command(lambda args: importlib.import_module(f"titanite.commands.{command}").main(args), argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: titanite {{{'|'.join(COMMANDS)}}} ...", file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"titanite: error: unknown command '{argv[0]}'", file=sys.stderr)
            return EXIT_USER_ERROR
        return 0
    return run(argv[0], argv[1:])


def entry() -> None:
    """The `titanite` console script and `python -m titanite.cli`."""
    from titanite.parallel.distributed import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()

"""`python -m tests.faults.crash_run --step S --kill-at K [--count-file F] [--children-file C] -- TRAIN ARGS`

Runs `titanite train TRAIN ARGS` in this process with tests/faults/inject.CrashPoints installed:
the process SIGKILLs itself at the K-th file-system operation of the save of step S (K = 0
only records them, and writes their list to F as JSON), first writing the pids of its child
processes to C.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.faults.inject import CrashPoints


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--count-file", default="")
    parser.add_argument("--children-file", default="")
    args, rest = parser.parse_known_args()
    rest = rest[1:] if rest[:1] == ["--"] else rest
    points = CrashPoints(args.step, args.kill_at, args.children_file)
    points.install()
    from titanite import cli

    code = cli.main(["train", *rest])
    if args.count_file:
        Path(args.count_file).write_text(json.dumps(points.events))
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Run a module with the test device loaded: `python -m titanite_testdev.run -m titanite.train ...`
(also under torchrun: `torchrun ... -m titanite_testdev.run -m titanite.train ...`)."""

from __future__ import annotations

import runpy
import sys

import titanite_testdev  # noqa: F401  (loads tdev before the module runs)

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "-m":
        sys.exit("usage: python -m titanite_testdev.run -m MODULE [ARGS ...]")
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)

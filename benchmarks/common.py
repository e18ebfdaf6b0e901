"""Pieces the benchmarks share (run them as scripts: `python benchmarks/<name>.py`)."""

from __future__ import annotations

import os
import platform
import subprocess
import time


def machine() -> str:
    """One line naming the CPU (lscpu's model name), cores, torch and transformers, and the date:
    figures are compared across sessions only on the same machine."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    import torch
    import transformers

    return (f"machine: {model}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {time.strftime('%Y-%m-%d')}")

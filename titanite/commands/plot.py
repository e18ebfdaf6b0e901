"""`titanite plot RUN_DIR [RUN_DIR ...] -o curves.png`: training curves of one or more runs.

Loss (with the held-out loss, dashed, when the run evaluated), learning rate and tokens/s against
the step, one panel each with a shared step axis and one colour per run, read from each run's
metrics.jsonl. Runs are labelled by folder name and, when their config.toml says, model.spec,
so two backends trained on the same config can be told apart at a glance.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titanite.commands.base import setup_logging
from titanite.core.errors import UserError

# (metrics.jsonl key, panel title); the loss panel also carries `eval_loss` when present.
PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_sec", "tokens/s"))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of `run_dir/metrics.jsonl`, in file order. Errors name the file (and line)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl: not a titanite run folder (job.output_dir)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n} is not valid JSON: {e}") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(f"{path}:{n} is not a metrics row (a JSON object with an integer 'step')")
        rows.append(row)
    if not rows:
        raise UserError(f"{path} has no rows yet")
    return rows


def run_label(run_dir: Path, taken: set[str]) -> str:
    """Folder name, plus `[spec]` from the run's config.toml; the full path if the name repeats."""
    label = run_dir.name or str(run_dir)
    config = run_dir / "config.toml"
    if config.is_file():
        try:
            spec = tomllib.loads(config.read_text()).get("model", {}).get("spec")
        except tomllib.TOMLDecodeError:
            spec = None
        if spec:
            label += f" [{spec}]"
    return str(run_dir) if label in taken else label


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have a finite `key` (NaN/Inf are logged as null)."""
    xs, ys = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(row["step"])
            ys.append(float(v))
    return xs, ys


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path):
    """Draw every run into one figure, write it to `out` (PNG, or any format matplotlib knows by
    the suffix) and return the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none touched
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    if not run_dirs:
        raise UserError("titanite plot: give at least one run folder")
    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    fig, axes = plt.subplots(len(PANELS), 1, sharex=True, figsize=(9, 2.6 * len(PANELS)), squeeze=False)
    axes = axes[:, 0]
    taken: set[str] = set()
    for colour, (run_dir, rows) in enumerate(runs):
        label = run_label(run_dir, taken)
        taken.add(label)
        for ax, (key, _) in zip(axes, PANELS):
            xs, ys = series(rows, key)
            ax.plot(xs, ys, color=f"C{colour}", label=label, marker="." if len(xs) < 50 else None)
            if key == "loss":
                ex, ey = series(rows, "eval_loss")
                if ex:
                    ax.plot(ex, ey, color=f"C{colour}", linestyle="--", marker="o", label=f"{label} eval")
    for ax, (_, title) in zip(axes, PANELS):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return fig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titanite plot",
                                     description="Draw loss, learning rate and tokens/s of one or more runs "
                                                 "(their metrics.jsonl) on shared axes.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (job.output_dir)")
    parser.add_argument("-o", "--out", default="curves.png", help="image to write (default curves.png)")
    args = parser.parse_args(argv)
    setup_logging()
    plot_runs(args.runs, args.out)
    logging.getLogger("titanite").info("wrote %s", args.out)
    return 0

"""`titanite plot`: curves of several runs from their metrics.jsonl, on shared axes."""

from __future__ import annotations

import math

import matplotlib.image
import pytest

from tests.conftest import run_cli
from titanite.commands.plot import plot_runs
from titanite.core.config import MetricsConfig
from titanite.core.errors import UserError
from titanite.run.metrics import MetricsLogger

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_run(folder, spec, steps, offset=0.0, eval_every=0):
    """A run folder as the trainer leaves it: config.toml and rows written by the real MetricsLogger."""
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(f'[model]\nspec = "{spec}"\n')
    logger = MetricsLogger(folder, MetricsConfig(progress_bar="off"), total_steps=steps)
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "loss": 5.0 / step + offset, "lr": 1e-3 * step / steps, "grad_norm": 1.0,
               "tokens_per_sec": 1000.0 + 10 * step + offset, "mfu": 0.01, "mem_gib": 0.5}
        if step == 3:
            row["tokens_per_sec"] = math.inf  # logged as null: a gap, not a crash
        if eval_every and step % eval_every == 0:
            row["eval_loss"] = 5.5 / step
        logger.log(row)
        rows.append(row)
    return rows


def test_plot_command_writes_a_png_with_every_run(tmp_path):
    runs = {"native": fake_run(tmp_path / "native", "qwen3", 8, eval_every=4),
            "hf": fake_run(tmp_path / "hf", "hf", 6, offset=0.1)}
    out = tmp_path / "figs" / "curves.png"
    proc = run_cli("plot", str(tmp_path / "native"), str(tmp_path / "hf"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(out).shape
    assert height > 100 and width > 100

    fig = plot_runs([tmp_path / "native", tmp_path / "hf"], tmp_path / "again.png")
    loss_ax, lr_ax, tps_ax = fig.axes
    assert loss_ax.get_shared_x_axes().joined(loss_ax, tps_ax)
    for ax, key in ((loss_ax, "loss"), (lr_ax, "lr"), (tps_ax, "tokens_per_sec")):
        lines = {line.get_label(): line for line in ax.get_lines()}
        for name, spec in (("native", "qwen3"), ("hf", "hf")):
            line = lines[f"{name} [{spec}]"]
            kept = [r for r in runs[name] if math.isfinite(r[key])]
            assert list(line.get_xdata()) == [r["step"] for r in kept]
            assert list(line.get_ydata()) == pytest.approx([r[key] for r in kept], rel=1e-12)
    evals = [line for line in loss_ax.get_lines() if line.get_label() == "native [qwen3] eval"]
    assert [tuple(line.get_xdata()) for line in evals] == [(4, 8)]


def test_plot_names_what_is_wrong(tmp_path):
    proc = run_cli("plot", str(tmp_path / "nowhere"), "-o", str(tmp_path / "c.png"))
    assert proc.returncode == 2 and "nowhere has no metrics.jsonl" in proc.stderr
    bad = tmp_path / "bad"
    fake_run(bad, "qwen3", 2)
    with open(bad / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(UserError, match=r"metrics\.jsonl:3 is not valid JSON"):
        plot_runs([bad], tmp_path / "c.png")
    assert not (tmp_path / "c.png").exists()

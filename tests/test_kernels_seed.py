"""The seed's three setups (tiny variants) train with the same launch line, and the example
kernel plugin verifies and trains, attached by config alone."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO, read_metrics, run_cli

SEEDS = ("seed-hf", "seed-native", "seed-moe-kernels")
EXAMPLE = "examples/custom_kernel/titanite_example_kernels"


def test_seed_configs_share_one_structure():
    """Same sections and keys in the three setups and their tiny variants, differing in values;
    the full-size ones are the published Qwen3 checkpoints, bf16."""
    configs = {name: tomllib.loads((REPO / "configs" / f"{name}.toml").read_text())
               for seed in SEEDS for name in (seed, f"{seed}-tiny")}
    structure = {section: set(table) - {"plugins"} for section, table in configs["seed-hf"].items()}
    for name, cfg in configs.items():
        got = {section: set(table) for section, table in cfg.items()}
        for section in structure:
            assert section in got, (name, section)
    assert configs["seed-hf"]["model"]["spec"] == "hf"
    assert configs["seed-native"]["model"]["spec"] == configs["seed-moe-kernels"]["model"]["spec"] == "qwen3"
    assert configs["seed-moe-kernels"]["kernels"]["moe.experts"] == "triton"
    assert configs["seed-moe-kernels"]["kernels"]["plugins"] == [EXAMPLE]
    for seed in SEEDS:
        assert configs[seed]["training"]["mixed_precision"] == "bf16"


@pytest.mark.slow
def test_tiny_seed_setups_train(tmp_path):
    """`titanite train --config configs/<seed>-tiny.toml` for all three (run side by side): exit
    0, a finite loss every step, an HF export; setup (c) ran the user's kernel on the q/k norms
    and the built-in grouped_mm experts."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    procs = {seed: subprocess.Popen([sys.executable, "-m", "titanite.cli", "train", "--config",
                                     f"configs/{seed}-tiny.toml", f"--job.output_dir={tmp_path / seed}"],
                                    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in SEEDS}
    logs = {}
    for seed, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{seed}: {err[-3000:]}"
        logs[seed] = err
        rows = read_metrics(tmp_path / seed)
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(math.isfinite(r["loss"]) for r in rows)
        assert (tmp_path / seed / "hf" / "config.json").is_file()
    assert "kernel attention:sdpa: hf.model.layers.[0-3].self_attn.attention" in logs["seed-hf"]
    assert "kernel loss:chunked: loss" in logs["seed-native"]
    moe = logs["seed-moe-kernels"]
    assert ("kernel rms_norm:example_rms_norm: layers.[0-3].attention.q_norm.kernel, "
            "layers.[0-3].attention.k_norm.kernel") in moe
    assert "kernel moe.experts:grouped_mm: layers.[0-3].feed_forward.experts.kernel" in moe


def test_example_kernel_verifies_with_the_same_command():
    proc = run_cli("kernels", "verify", "rms_norm", "--impl", "example_rms_norm", "--plugins", EXAMPLE,
                   "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("rms_norm")]
    assert len(table) == 9 and all(line.rstrip().endswith("| pass") for line in table)
    assert "9 passed, 0 failed" in proc.stdout

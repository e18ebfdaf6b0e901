"""The seed's three setups (tiny variants) train with the same launch line, and the example
kernel plugin verifies and trains, attached by config alone."""

from __future__ import annotations

import dataclasses
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
    """The three setups have the same sections and the same keys in each, differing in values
    (the full-size ones among themselves, the tiny ones among themselves); seed-hf and
    seed-native differ in model.spec alone. The full-size ones are the published Qwen3
    checkpoints, bf16."""
    configs = {name: tomllib.loads((REPO / "configs" / f"{name}.toml").read_text())
               for seed in SEEDS for name in (seed, f"{seed}-tiny")}
    for variant in ("", "-tiny"):
        group = {seed: configs[seed + variant] for seed in SEEDS}
        keys = {seed: {section: set(table) for section, table in cfg.items()} for seed, cfg in group.items()}
        assert keys["seed-hf"] == keys["seed-native"] == keys["seed-moe-kernels"], keys
        hf, native = (dict(group[s]) for s in ("seed-hf", "seed-native"))
        for cfg in (hf, native):
            cfg["job"], cfg["model"] = {**cfg["job"], "output_dir": ""}, {**cfg["model"], "spec": ""}
        assert hf == native, variant
    assert configs["seed-hf"]["model"]["spec"] == configs["seed-hf-tiny"]["model"]["spec"] == "hf"
    assert configs["seed-native"]["model"]["spec"] == configs["seed-moe-kernels"]["model"]["spec"] == "qwen3"
    assert configs["seed-moe-kernels"]["kernels"]["moe.experts"] == "triton"
    assert configs["seed-moe-kernels"]["kernels"]["plugins"] == [EXAMPLE]
    for seed in SEEDS:
        assert configs[seed]["training"]["mixed_precision"] == "bf16"


@pytest.mark.slow
def test_every_tiny_seed_trains_under_both_specs_with_one_key_changed(tmp_path, monkeypatch):
    """Each tiny seed config, as written and with only model.spec flipped: the same loss at every
    step (both backends draw the same initial weights for the seed; within the backend-parity
    tolerance, 1e-4 relative) and the user's plugin kernel called the same number of times."""
    import importlib

    from titanite.core.config import load_config
    from titanite.kernels import registry
    from titanite.run.trainer import Trainer

    monkeypatch.syspath_prepend(str(REPO / "examples" / "custom_kernel"))
    importlib.import_module("titanite_example_kernels")  # registered once; the trainer's import is a no-op
    impl = registry.get("rms_norm", "example_rms_norm")
    calls = [0]

    def counted(*args, **kw):
        calls[0] += 1
        return impl.fn(*args, **kw)

    counted.__signature__ = registry.signature("rms_norm")
    monkeypatch.setitem(registry._IMPLS["rms_norm"], "example_rms_norm", dataclasses.replace(impl, fn=counted))
    for seed in SEEDS:
        losses, counts = {}, {}
        for spec in ("hf", "qwen3"):
            calls[0] = 0
            out = tmp_path / f"{seed}-{spec}"
            cfg = load_config(str(REPO / "configs" / f"{seed}-tiny.toml"),
                              [f"--model.spec={spec}", f"--job.output_dir={out}", "--metrics.progress_bar=off"])
            trainer = Trainer(cfg)
            trainer.train()
            trainer.close()
            losses[spec] = [r["loss"] for r in read_metrics(out)]
            counts[spec] = calls[0]
        assert len(losses["hf"]) == len(losses["qwen3"]) == 3, seed
        for a, b in zip(losses["hf"], losses["qwen3"]):
            assert abs(a - b) <= 1e-4 * abs(b), (seed, losses)
        assert counts["hf"] == counts["qwen3"] > 0, (seed, counts)


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
    assert ("kernel rms_norm:example_rms_norm: hf.model.layers.[0-3].self_attn.q_norm.kernel, "
            "hf.model.layers.[0-3].self_attn.k_norm.kernel") in logs["seed-hf"]
    assert "kernel loss:chunked: hf.lm_head.loss" in logs["seed-hf"]
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


def test_example_kernel_verifies_through_the_transformers_call_sites():
    """The user's kernel, checked where the hf backend calls it: `kernels verify --spec hf`."""
    proc = run_cli("kernels", "verify", "rms_norm", "--impl", "example_rms_norm", "--plugins", EXAMPLE,
                   "--device", "cpu", "--spec", "hf", "--dtype", "float32", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("rms_norm")]
    assert len(table) == 2 and all(line.rstrip().endswith("| pass") for line in table), proc.stdout
    assert "through the hf model's call sites" in proc.stdout

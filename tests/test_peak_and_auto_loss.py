"""Honest MFU (a bounded, cached CPU peak; never above 100%; a warning for slow CPU bf16),
`loss = "auto"` choosing the loss by memory, and the CPU host-memory policy."""

from __future__ import annotations

import logging
import sys
import time

import pytest
import torch

from tests.conftest import read_metrics, tiny_train_args
from titanite.core.config import load_config
from titanite.device import peak as device_peak
from titanite.device.peak import Peak, measured_peak, warn_if_slow_bf16
from titanite.models.spec import get_spec
from titanite.run import preflight as preflight_module
from titanite.run.preflight import choose_loss
from titanite.run.trainer import Trainer

CPU = torch.device("cpu")


def test_cpu_peak_is_bounded_in_time_and_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    start = time.perf_counter()
    first = measured_peak(CPU, torch.float32)
    assert time.perf_counter() - start < 5  # ~0.3 s unloaded; generous for a shared CI machine
    assert first.source == "measured" and first.flops > 1e8
    assert (tmp_path / "titanite" / "peak_flops.json").is_file()
    monkeypatch.setattr(device_peak, "measure_gemm_flops", lambda *a, **kw: pytest.fail("measured again"))
    again = measured_peak(CPU, torch.float32)
    assert again.source == "measured, cached" and again.flops == first.flops
    assert "GFLOP/s" in again.describe() or "TFLOP/s" in again.describe()


def test_slow_cpu_bf16_warns_once_with_both_numbers(monkeypatch, caplog):
    peaks = {torch.bfloat16: Peak(0.17e9, "measured"), torch.float32: Peak(32e9, "measured")}
    monkeypatch.setattr(device_peak, "measured_peak", lambda device, dtype, refresh=False: peaks[dtype])
    with caplog.at_level(logging.WARNING, logger="titanite"):
        warn_if_slow_bf16(CPU)
    assert "0.2 GFLOP/s" in caplog.text and "32.0 GFLOP/s" in caplog.text and "mixed_precision = 'none'" in caplog.text
    caplog.clear()
    peaks[torch.bfloat16] = Peak(200e9, "measured")  # bf16 matrix units: no warning
    warn_if_slow_bf16(CPU)
    assert caplog.text == ""


@pytest.mark.parametrize("peak, expected", [("configured", "null"), ("measured", "remeasured")])
def test_mfu_is_never_reported_above_100_percent(tmp_path, tiny_hf, tiny_data, monkeypatch, caplog, peak, expected):
    trainer = Trainer(load_config(None, tiny_train_args(tiny_hf, tiny_data, tmp_path / "run", steps=2)))
    trainer.close()
    fast = trainer.flops_per_token * 1000  # FLOP/s achieved at 1000 tokens/s
    trainer.mfu.peak = Peak(fast / 2, "metrics.peak_tflops" if peak == "configured" else "measured")
    monkeypatch.setattr(device_peak, "measured_peak", lambda *a, **kw: Peak(fast * 4, "measured"))
    with caplog.at_level(logging.WARNING, logger="titanite"):
        mfu = trainer.mfu(1000.0)
    if expected == "null":
        assert mfu is None and "left out (null)" in caplog.text
        # ...and the progress line still prints (it crashed on a null mfu)
        with caplog.at_level(logging.INFO, logger="titanite"):
            trainer.metrics._console({"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0,
                                      "tokens_per_sec": 1000.0, "mfu": mfu})
        assert "1,000 tok/s mfu n/a" in caplog.text
    else:
        assert mfu == pytest.approx(0.25) and "measured again" in caplog.text


def test_progress_line_and_metrics_carry_a_finite_mfu(tmp_path, tiny_hf, tiny_data):
    out = tmp_path / "run"
    args = tiny_train_args(tiny_hf, tiny_data, out, steps=2, **{"metrics.peak_tflops": 0.0})
    trainer = Trainer(load_config(None, args))
    trainer.train()
    assert all(r["mfu"] is None or 0 < r["mfu"] <= 1 for r in read_metrics(out))


@pytest.mark.parametrize("batch, memory, want", [(4, 64 * 2**30, "reference"), (4, 2**30, "chunked")])
def test_auto_loss_chooses_by_the_logits_share_of_memory(monkeypatch, caplog, batch, memory, want):
    cfg = load_config(None, [f"--training.batch_size={batch}", "--data.seq_len=256"])  # debug flavor: 151,936 vocab
    handle = get_spec("qwen3").build(cfg.model)
    monkeypatch.setattr(preflight_module, "total_memory", lambda device: memory)
    with caplog.at_level(logging.INFO, logger="titanite"):
        chosen = choose_loss(cfg, handle, CPU)
    assert chosen.select["loss"] == want
    logits_gib = batch * 256 * 151936 * 4 / 2**30
    assert f"auto -> {want}" in caplog.text and f"{logits_gib:.2f} GiB" in caplog.text
    explicit = load_config(None, ["--kernels.loss=chunked"])
    assert choose_loss(explicit, handle, CPU).select["loss"] == "chunked"  # an explicit choice wins


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("ranks, env, want", [(1, None, "keep"), (2, None, "return"), (2, "1", "keep"),
                                              (1, "0", "return")])
def test_host_memory_policy_follows_the_ranks_on_the_host(ranks, env, want):
    """One process keeps freed host memory; ranks sharing a host return it; the variable forces
    either. Each in its own process: the policy is process-wide."""
    import os
    import subprocess

    environ = {k: v for k, v in os.environ.items() if k != "TITANITE_KEEP_FREED_MEMORY"}
    if env is not None:
        environ["TITANITE_KEEP_FREED_MEMORY"] = env
    out = subprocess.run([sys.executable, "-c", "from titanite.device import set_host_memory_policy; "
                          f"print(set_host_memory_policy({ranks}))"], env=environ, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == want

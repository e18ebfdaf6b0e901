"""Named accelerators: the table's lookup by reported device name, the MFU peak it gives
(configured > table > measured), and `titanite estimate` planning for a named accelerator on
this CPU, with the smallest world the layout allows."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO, run_cli
from titanite.cli import main as cli_main
from titanite.core.config import load_config
from titanite.device import accelerators
from titanite.device import peak as device_peak
from titanite.device.peak import Peak, device_name, peak_flops
from titanite.parallel.mesh import ParallelDims

META = torch.device("meta")  # a non-CPU device that needs no hardware; its name is patched in
NATIVE_TINY = str(REPO / "configs" / "seed-native-tiny.toml")
MOE_TINY = str(REPO / "configs" / "seed-moe-kernels-tiny.toml")


@pytest.mark.parametrize("reported, name", [
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),  # the longer key wins over "H100"
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA GH200 480GB", "GH200"),  # ... and "GH200" over "H200"
    ("NVIDIA H200", "H200"),
    ("NVIDIA GB200", "GB200"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L40", "L40"),
    ("NVIDIA L4", "L4"),
    ("AMD Instinct MI300X", "MI300X"),
    ("h100", "H100"),  # any case, as typed for --device-name
    ("trn2", "Trainium2"),
    ("GAUDI3", "Gaudi3"),
])
def test_lookup_by_reported_name(reported, name):
    assert accelerators.lookup(reported).name == name


@pytest.mark.parametrize("reported", ["NVIDIA RTX A1000", "NVIDIA GeForce RTX 4090", "NVIDIA A10G", "cpu", ""])
def test_lookup_misses_other_devices(reported):
    assert accelerators.lookup(reported) is None  # "A100" is not part of "A1000", nor "L4" of "L40"


def test_every_name_and_alias_finds_its_own_entry():
    for acc in accelerators._TABLE:
        for key in (acc.name, *acc.aliases):
            assert accelerators.lookup(key) is acc, key
    assert accelerators.names() == [acc.name for acc in accelerators._TABLE]
    assert len(set(accelerators.names())) == len(accelerators.names())


def test_table_holds_the_documented_numbers():
    h100, h200, mi300x = (accelerators.lookup(n) for n in ("H100", "H200", "MI300X"))
    assert (h100.memory_gib, h100.bf16_tflops, h100.fp32_tflops) == (80, 989, 67)
    assert (h200.memory_gib, h200.bf16_tflops) == (141, 989)
    assert (mi300x.memory_gib, mi300x.bf16_tflops) == (192, 1307.4)
    # Trainium: per logical NeuronCore, a quarter of a Trn2 chip (96 GiB, 667 TFLOP/s bf16).
    trn2 = accelerators.lookup("Trainium2")
    assert (trn2.memory_gib * 4, trn2.bf16_tflops * 4) == (96, 667)
    for acc in accelerators._TABLE:
        assert acc.memory_gib > 0 and acc.bf16_tflops > 0
        assert acc.fp32_tflops is None or 0 < acc.fp32_tflops < acc.bf16_tflops, acc


def test_device_name_asks_the_device_module(monkeypatch):
    assert device_name(torch.device("cpu")) is None
    assert device_name(META) is None  # no torch.meta module
    fake = SimpleNamespace(get_device_name=lambda index=None: f"Fake Accelerator {index}")
    monkeypatch.setattr(torch, "xpu", fake)
    assert device_name(torch.device("xpu", 1)) == "Fake Accelerator 1"


def _no_measuring(monkeypatch):
    monkeypatch.setattr(device_peak, "measured_peak", lambda *a, **kw: pytest.fail("measured a peak"))


def test_peak_comes_from_the_table_by_the_reported_name(monkeypatch):
    _no_measuring(monkeypatch)
    monkeypatch.setattr(device_peak, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    bf16 = peak_flops(META, torch.bfloat16)
    assert bf16.flops == 989e12 and bf16.source == "H100 table, bf16"
    assert peak_flops(META, torch.float32).flops == 67e12
    configured = peak_flops(META, torch.bfloat16, configured_tflops=123.0)  # configured beats the table
    assert configured.flops == 123e12 and configured.source == "metrics.peak_tflops"


def test_an_unknown_device_is_measured_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(device_peak, "device_name", lambda device: "Mystery Accelerator 9000")
    monkeypatch.setattr(device_peak, "measured_peak", lambda device, dtype, refresh=False: Peak(5e12, "measured"))
    with caplog.at_level(logging.WARNING, logger="titanite"):
        peak = peak_flops(META, torch.bfloat16)
    assert peak.source == "measured"
    assert "Mystery Accelerator 9000" in caplog.text and "metrics.peak_tflops" in caplog.text


def _estimate(capsys, *args: str) -> str:
    assert cli_main(["estimate", *args]) == 0
    return capsys.readouterr().out


def test_estimate_plans_with_the_named_accelerators_peak_and_memory(capsys):
    out = _estimate(capsys, "--config", NATIVE_TINY, "--plan-for", "accelerator", "--device-name", "H100",
                    "--training.mixed_precision=bf16", "--rehearse")
    assert "device peak for MFU: 989.0 TFLOP/s (H100 table, bf16); one step takes" in out
    assert "fits 80 GiB" in out  # --device-memory-gib from the table
    # --device-name alone implies --plan-for accelerator; fp32 runs plan with fp32's peak.
    assert "67.0 TFLOP/s (H100 table, fp32)" in _estimate(capsys, "--config", NATIVE_TINY, "--device-name", "h100")


def test_estimate_for_an_unnamed_accelerator_prints_no_cpu_peak(capsys):
    out = _estimate(capsys, "--config", NATIVE_TINY, "--plan-for", "accelerator")
    assert "device peak for MFU: unknown (no accelerator named); pass --device-name NAME" in out
    assert "one step takes" not in out
    out = _estimate(capsys, "--config", NATIVE_TINY, "--plan-for", "accelerator", "--metrics.peak_tflops=500")
    assert "500.0 TFLOP/s (metrics.peak_tflops)" in out


def test_estimate_refuses_an_unknown_device_name():
    proc = run_cli("estimate", "--config", NATIVE_TINY, "--device-name", "Z9000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "--device-name 'Z9000' is not a known accelerator; known: H100, H100 PCIe" in proc.stderr


@pytest.mark.parametrize("overrides", [["--parallelism.ep=8"],
                                       ["--parallelism.ep=4", "--parallelism.tp=2", "--parallelism.dp_replicate=2"],
                                       ["--parallelism.dp_shard=2"],
                                       ["--parallelism.cp=2", "--parallelism.ep=2"]])
def test_estimate_defaults_to_the_smallest_world_the_layout_allows(capsys, overrides):
    p = load_config(MOE_TINY, overrides).parallelism
    dp_shard = p.dp_shard if p.dp_shard > 0 else p.ep  # dp_shard = -1 takes the fewest ranks ep divides
    world = p.dp_replicate * dp_shard * p.cp * p.tp
    out = _estimate(capsys, "--config", MOE_TINY, "--metrics.peak_tflops=1", *overrides)
    assert f"world size: {world} (the smallest the layout allows; pass --world-size to choose)" in out
    cp = f"cp={p.cp}, " if p.cp > 1 else ""
    assert (f"layout: {world} ranks (dp_replicate={p.dp_replicate}, dp_shard={dp_shard}, {cp}tp={p.tp}, "
            f"ep={p.ep})") in out


def test_smallest_world_counts_every_degree():
    """A new degree in ParallelDims (cp, pp, ...) takes ranks: titanite.commands.estimate.smallest_world
    must count it, and this test then lists it."""
    assert {f.name for f in dataclasses.fields(ParallelDims)} == {"dp_replicate", "dp_shard", "tp", "ep", "world_size",
                                                                 "cp", "pp"}

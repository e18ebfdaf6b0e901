"""`titanite device check` on the project's test device `tdev` (loaded only in subprocesses: imported
here it would make torch.accelerator report tdev for every later test), and on the CPU in-process.

The oracles: the CPU's own run of the same training steps, known answers for the collectives,
and the backend's documented capabilities (tdev's allocator keeps no statistics; it pins memory
unless TITANITE_TESTDEV_PINNED=0; it registers no c10d backend under TITANITE_TESTDEV_C10D=0)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from tests.conftest import run_cli
from titanite.commands import device as device_check
from titanite.kernels.registry import OPS

COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single",
               "broadcast_object_list")
TRAINING = ("training step 1", "training step 2", "training after step 2")


def check_tdev(*args: str, env: dict | None = None):
    return run_cli("-m", "titanite.cli", "device", "check", "--device", "tdev", *args, env=env, timeout=300,
                   module="titanite_testdev.run")


def lines_of(stdout: str) -> dict[str, tuple[str, str]]:
    """check name -> (status, detail) for every `status  name: detail` line."""
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"^(ok|n/a|FAIL)\s+([^:]+): (.*)$", line)
        if m:
            found[m.group(2)] = (m.group(1), m.group(3))
    return found


def rel_diff(detail: str) -> float:
    return float(re.search(r"rel diff (\S+)", detail).group(1))


def test_tdev_is_ready_with_two_ranks():
    proc = check_tdev("--nproc", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    found = lines_of(proc.stdout)
    names = ["device", "c10d backend", *(f"kernels {op}" for op in OPS), "memory statistics", "pinned host memory",
             "compile", *TRAINING, "process group", *COLLECTIVES]
    assert [n for n in names if n not in found] == [], proc.stdout
    assert not [n for n, (s, _) in found.items() if s == "FAIL"], proc.stdout
    assert re.match(r'tdev:0 \("titanite test device 0"\), 4 devices', found["device"][1])
    assert found["c10d backend"] == ("ok", "cpu:gloo,tdev:tdevccl")
    assert found["memory statistics"][0] == "n/a" and "keeps none" in found["memory statistics"][1]
    assert found["pinned host memory"][0] == "ok"
    assert found["compile"][0] == "ok" and found["compile"][1].startswith("aot_eager")
    # tdev runs sdpa, gather and chunked (grouped_mm and triton do not run there): each verified.
    assert {n for n in found if n.startswith("verified ")} == {
        "verified attention sdpa", "verified moe.dispatch gather", "verified loss chunked"}
    assert "grouped_mm (runs on cpu, cuda, not tdev)" in found["kernels moe.experts"][1]
    for name in TRAINING:
        assert found[name][0] == "ok" and rel_diff(found[name][1]) <= 1e-5, found[name]
    assert all(found[n][0] == "ok" for n in ("process group", *COLLECTIVES))
    assert "2 ranks" in found["all_to_all_single"][1]
    assert proc.stdout.rstrip().splitlines()[-1] == "tdev:0: 24 ok, 1 n/a, 0 FAIL: ready for titanite"


def test_tdev_without_pinned_memory_says_so():
    proc = check_tdev("--dtype", "float32", env={"TITANITE_TESTDEV_PINNED": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    found = lines_of(proc.stdout)
    assert found["pinned host memory"][0] == "n/a", found["pinned host memory"]
    assert "checking float32" in found["device"][1]
    assert "process group" not in found  # no --nproc: no collectives


def test_tdev_without_a_c10d_backend_fails_with_nproc():
    proc = check_tdev("--nproc", "2", "--dtype", "float32", env={"TITANITE_TESTDEV_C10D": "0"})
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    found = lines_of(proc.stdout)
    status, detail = found["c10d backend"]
    assert status == "FAIL" and "no torch.distributed backend is registered for device type 'tdev'" in detail
    assert found["collectives"][0] == "FAIL"
    assert found["training step 1"][0] == "ok"  # the rest of the checks still ran
    assert "NOT ready" in proc.stdout.splitlines()[-1]


@pytest.mark.parametrize("args, says", [
    (("--device", "nosuch"), "unknown device 'nosuch'"),
    (("--device", "tdev", "--nproc", "0"), "--nproc must be at least 1"),
    (("--device", "tdev", "--nproc", "5"), "this machine has 4 tdev device(s)"),
], ids=["unknown-device", "nproc-0", "nproc-over-count"])
def test_bad_input_is_one_clear_error(args, says):
    proc = run_cli("-m", "titanite.cli", "device", "check", *args, module="titanite_testdev.run", timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("titanite: error:") and says in errors[0], proc.stderr


def test_cpu_in_process(capsys):
    assert device_check.main(["check", "--device", "cpu"]) == 0
    found = lines_of(capsys.readouterr().out)
    assert found["device"][1].startswith("the host CPU")
    assert found["memory statistics"][0] == "n/a" and found["pinned host memory"][0] == "n/a"
    assert found["verified moe.experts grouped_mm"][0] == "ok"  # grouped_mm runs on the CPU
    assert all(found[n][0] == "ok" and rel_diff(found[n][1]) == 0.0 for n in TRAINING)


def test_the_training_check_fails_when_the_device_computes_something_else():
    """Not vacuous: one weight of the "device" copy moved by half the init's standard deviation
    (one element of ~90k) is enough to FAIL every loss line."""
    model = device_check.tiny_model()
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.layers[0].attention.wo.weight[0, 0] += 0.01
    checks = device_check.compare_training(model, torch.device("cpu"), device_model=other)
    assert [c.name for c in checks] == list(TRAINING)
    assert [c.status for c in checks] == ["FAIL"] * 3, [c.line() for c in checks]
    assert all(rel_diff(c.detail) > 1e-5 for c in checks)

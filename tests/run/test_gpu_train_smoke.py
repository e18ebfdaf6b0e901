"""benchmarks/gpu_train.py end to end on CPU (--smoke): every row of both models trains, writes
its table, and the rows agree on the loss (they start from the same weights and data)."""

import importlib.util

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_gpu_train_benchmark_runs_end_to_end_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_train", REPO / "benchmarks" / "gpu_train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "gpu_train.md").read_text()
    assert table.count("losses agree: yes") == 2
    for row in ("| hf |", "| native |", "| native + compile |", "| native + sdpa + Triton |"):
        assert table.count(row) == 2, row

"""Sharded start-up under torchrun (gloo, CPU): every layout starts from the same weights.

Each case starts a trainer with tests/fixtures/startup_probe.py and exports its weights before any step.
- Random init: the export is bitwise equal to the single-process export of the same backend,
  and both backends draw the same tensors.
- Pretrained load: the export is bitwise equal to the published checkpoint's tensors (written
  by transformers), and each rank read about its share of the bytes, counted by a wrapper
  around safetensors' reader.
- No rank allocates more, while it materialises, than its own shards plus the largest tensor of
  the Hugging Face layout (profiler allocation events).
Since rank 0 writes the export from tensors gathered one at a time, the export from 2 and 4
ranks being bitwise equal to the single-process one is checked here too.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, TINY_MOE, make_hf_checkpoint, tiny_train_args, write_corpus
from tests.parallel.test_distributed import _env

SLACK = 64 * 1024  # small temporaries while materialising (index tensors, the RoPE tables' inputs)

# name: (checkpoint, ranks, overrides); "fsdp" layouts shard every tensor (nothing replicated)
LAYOUTS = {
    "fsdp2": ("dense", 2, {}),
    "tp2": ("dense", 2, {"parallelism.tp": 2}),
    "ep2": ("moe", 2, {"parallelism.ep": 2}),
    "hf_fsdp2_tied": ("tied", 2, {"model.spec": "hf"}),
    "hf_tp2_tied": ("tied", 2, {"model.spec": "hf", "parallelism.tp": 2}),
    "hf_ep2": ("moe", 2, {"model.spec": "hf", "parallelism.ep": 2}),
    "fsdp4": ("dense", 4, {}),
    "hsdp": ("dense", 4, {"parallelism.dp_replicate": 2}),
    "fsdp_tp": ("dense", 4, {"parallelism.tp": 2}),
    "fsdp_ep": ("moe", 4, {"parallelism.ep": 2}),
    "hf_fsdp_ep": ("moe", 4, {"model.spec": "hf", "parallelism.ep": 2}),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data") / "data.jsonl")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("startup")
    return {
        "dense": make_hf_checkpoint(root / "dense", tiny_tokenizer_dir),
        "tied": make_hf_checkpoint(root / "tied", tiny_tokenizer_dir, seed=1, tie_word_embeddings=True),
        "moe": make_hf_checkpoint(root / "moe", tiny_tokenizer_dir, seed=2, **TINY_MOE),
    }


def probe(ranks: int, report: Path, overrides: list[str]) -> list[dict]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable])
    proc = subprocess.run([*launcher, "-m", "tests.fixtures.startup_probe", str(report), *overrides], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=_env())
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((report / f"rank-{r}.json").read_text()) for r in range(ranks)]


def overrides_for(hf: Path, data: Path, out: Path, init: str, extra: dict) -> list[str]:
    return tiny_train_args(hf, data, out / "run", steps=2, **{"model.init": init, "checkpoint.interval": 0,
                                                              **extra})


def exported_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


def on_disk(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in sorted(folder.glob("*.safetensors")):
        out.update(load_file(p))
    return out


@pytest.fixture(scope="module")
def single(checkpoints, data, tmp_path_factory):
    """The single-process probe per (checkpoint, backend, init), run once each."""
    done: dict[tuple, tuple[Path, list[dict]]] = {}

    def get(name: str, spec: str, init: str) -> tuple[Path, list[dict]]:
        key = (name, spec, init)
        if key not in done:
            report = tmp_path_factory.mktemp(f"single-{name}-{spec}-{init}")
            extra = {"model.spec": spec}
            done[key] = report, probe(1, report, overrides_for(checkpoints[name], data, report, init, extra))
        return done[key]
    return get


def assert_bounded(stats: list[dict]) -> None:
    """Start-up holds the rank's shards plus one on-disk tensor; the export, beyond the shards
    it already holds, one on-disk tensor (rank 0, which writes it) or less."""
    for r, s in enumerate(stats):
        assert s["peak"] <= s["local"] + s["largest"] + SLACK, (r, s)
        assert s["export_peak"] <= s["largest"] + SLACK, (r, s)


@pytest.mark.parametrize("init", ["random", "pretrained"])
@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.slow] if LAYOUTS[n][1] > 2 else [])
                                    for n in LAYOUTS])
def test_every_layout_starts_from_the_single_process_weights(layout, init, checkpoints, data, single,
                                                             tmp_path):
    name, ranks, extra = LAYOUTS[layout]
    spec = extra.get("model.spec", "qwen3")
    mode = "random" if init == "random" else "auto"
    reference, ref_stats = single(name, spec, mode)
    stats = probe(ranks, tmp_path, overrides_for(checkpoints[name], data, tmp_path, mode, extra))
    assert exported_bytes(tmp_path / "hf") == exported_bytes(reference / "hf")
    assert_bounded(ref_stats + stats)
    if init == "random":
        assert all(s["read"] == 0 for s in stats)
        return
    published = on_disk(checkpoints[name])
    total = sum(t.numel() * t.element_size() for t in published.values())
    assert ref_stats[0]["read"] == total
    for s in stats:  # a rank reads what it holds (replicated tensors included), never more
        assert 0 < s["read"] <= s["local"]
    if len(extra) == (1 if "model.spec" in extra else 0):  # FSDP only: every byte read once, in all
        assert sum(s["read"] for s in stats) == total
        assert max(s["read"] for s in stats) <= 1.2 * total / ranks


@pytest.mark.parametrize("name", ["tied", "moe"])
def test_both_backends_draw_the_same_random_init(name, single):
    native, _ = single(name, "qwen3", "random")
    hf, _ = single(name, "hf", "random")
    a, b = on_disk(native / "hf"), on_disk(hf / "hf")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_pretrained_load_is_the_published_weights(name, checkpoints, single):
    exported, _ = single(name, "qwen3", "auto")
    a, b = on_disk(exported / "hf"), on_disk(checkpoints[name])
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["dense", "tied", "moe"])
def test_export_command_streams_a_two_rank_checkpoint(name, checkpoints, data, tmp_path):
    """`titanite export` of a checkpoint saved by 2 FSDP ranks: the files are the run's own
    end-of-run export, byte for byte, and the command never restores the model: its peak is one
    on-disk tensor plus the stored chunks (one saving rank's shard) it overlaps."""
    from tests.fixtures.startup_probe import _peak_live_bytes, _profiled
    from titanite.commands.export import export_checkpoint
    from titanite.formats import dcp_safe

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "titanite.train", *tiny_train_args(checkpoints[name], data, run, steps=2)],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    step = run / "checkpoints" / "step-2"
    with _profiled() as prof:
        export_checkpoint(step, tmp_path / "exp", shard_mb=1)
    peak = _peak_live_bytes(prof, set())
    assert exported_bytes(tmp_path / "exp") == exported_bytes(run / "hf")
    published = on_disk(run / "hf")
    largest = max(t.numel() * t.element_size() for t in published.values())
    metadata = dcp_safe.read_metadata(step)
    model = {k: md for k, md in metadata.state_dict_metadata.items() if k.startswith("model.")}
    chunk = max(math.prod(c.sizes) * md.properties.dtype.itemsize for md in model.values() for c in md.chunks)
    whole = sum(math.prod(md.size) * md.properties.dtype.itemsize for md in model.values())
    assert peak <= largest + chunk + SLACK, (peak, largest, chunk)
    assert largest + chunk < whole / 2  # so the bound says something

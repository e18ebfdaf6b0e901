"""The parallel layouts of Qwen3.5 / Qwen3-Next (Gated DeltaNet + gated attention, dense and MoE
with a shared expert) against one process, on both backends, under torchrun with gloo on CPU.

Each layout runs 4 steps of the same global batch as its own single-process run: losses within
1e-5 relative, gradient norms within 1e-4 relative, and the Hugging Face export equal tensor for
tensor within 1e-5. FSDP2 shards every block; tensor parallelism splits the Gated DeltaNet and
attention heads over the ranks (hybrid_tp.py); expert parallelism shards the routed experts,
the shared expert staying with the block like a dense MLP.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.fixtures.hybrid import make_hybrid_checkpoint
from tests.parallel.test_distributed import args_for, assert_same_export, single_process, torchrun
from tests.parallel.test_distributed import data  # noqa: F401 (the shared corpus fixture)

STEPS = 4
LOSS_REL, GRAD_REL = 1e-5, 1e-4

# family fixture -> model_type; the MoE hybrid is Qwen3-Next, whose fused projections are grouped
# by key head (Qwen3.5's are block-ordered: both layouts of the Gated DeltaNet weights are covered).
FAMILIES = {"dense": "qwen3_5_text", "moe": "qwen3_next"}

# name: (family, ranks, overrides); the single-process reference drops the parallelism keys.
LAYOUTS = {
    "dense_fsdp": ("dense", 2, {}),
    "dense_hf_fsdp": ("dense", 2, {"model.spec": "hf"}),
    "dense_tp": ("dense", 2, {"parallelism.tp": 2}),
    "dense_hf_tp": ("dense", 2, {"model.spec": "hf", "parallelism.tp": 2}),
    "moe_fsdp": ("moe", 2, {}),
    "moe_hf_fsdp": ("moe", 2, {"model.spec": "hf"}),
    "moe_tp": ("moe", 2, {"parallelism.tp": 2}),
    "moe_hf_tp": ("moe", 2, {"model.spec": "hf", "parallelism.tp": 2}),
    "moe_ep": ("moe", 2, {"parallelism.ep": 2}),
    "moe_hf_ep": ("moe", 2, {"model.spec": "hf", "parallelism.ep": 2}),
}
FAST = {"dense_fsdp", "dense_tp", "moe_ep", "moe_hf_tp"}  # one of each piece and backend; the rest slow


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    """One tiny checkpoint per family, with the tiny tokenizer, shared by the module."""
    out = {}
    for key, family in FAMILIES.items():
        folder = make_hybrid_checkpoint(tmp_path_factory.mktemp(key), family)
        for f in tiny_tokenizer_dir.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        out[key] = folder
    return out


@pytest.fixture(scope="module")
def references(checkpoints, data, tmp_path_factory):
    """The single-process run of (family, overrides without parallelism), each run once and
    shared by every layout of it."""
    done: dict[tuple, Path] = {}

    def reference(family: str, extra: dict) -> Path:
        kept = {k: v for k, v in extra.items() if not k.startswith("parallelism.")}
        key = (family, tuple(sorted(kept.items())))
        if key not in done:
            out = tmp_path_factory.mktemp("ref") / "run"
            single_process(args_for(checkpoints[family], data, out, STEPS, **kept))
            done[key] = out
        return done[key]

    return reference


def assert_same_metrics(reference: Path, run: Path) -> None:
    ref, rows = read_metrics(reference), read_metrics(run)
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for a, b in zip(ref, rows, strict=True):
        assert abs(b["loss"] - a["loss"]) <= LOSS_REL * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(b["grad_norm"] - a["grad_norm"]) <= GRAD_REL * abs(a["grad_norm"]), (a["step"], "grad_norm")
        if "aux_loss" in a:
            assert abs(b["aux_loss"] - a["aux_loss"]) <= GRAD_REL * abs(a["aux_loss"]) + 1e-9, (a["step"], "aux")


def _params(names) -> list:
    return [pytest.param(n, marks=[] if n in FAST else [pytest.mark.slow]) for n in names]


@pytest.mark.parametrize("layout", _params(LAYOUTS))
def test_hybrid_layout_matches_single_process(layout, checkpoints, references, data, tmp_path):
    family, ranks, extra = LAYOUTS[layout]
    ref = references(family, extra)
    proc = torchrun(ranks, args_for(checkpoints[family], data, tmp_path / "run", STEPS, **extra))
    assert_same_metrics(ref, tmp_path / "run")
    assert_same_export(ref / "hf", tmp_path / "run" / "hf")
    if "parallelism.ep" in extra:  # the routed experts really were sharded
        assert f"on this rank (ep={extra['parallelism.ep']})" in proc.stderr + proc.stdout


# -- layouts checked before any work ----------------------------------------------------------

def test_tensor_parallel_degree_must_divide_the_delta_key_heads():
    from titanite.core.errors import UserError
    from titanite.parallel.mesh import ParallelDims

    config = {"num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 384, "intermediate_size": 96,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4}
    ParallelDims(1, 1, 2, 1, 2).check_model(config)
    with pytest.raises(UserError, match=r"parallelism.tp \(4\) must divide linear_num_key_heads \(2\)"):
        ParallelDims(1, 1, 4, 1, 4).check_model(config)
    # an MoE model with no dense layers has no intermediate_size to divide
    ParallelDims(1, 1, 2, 1, 2).check_model({**config, "intermediate_size": None, "num_experts": 4})


def test_lora_with_tensor_parallel_is_refused_for_hybrid_models(tmp_path, checkpoints, data):
    from tests.conftest import tiny_train_args
    from titanite.core.config import load_config
    from titanite.core.errors import UserError
    from titanite.run.preflight import preflight

    cfg = load_config(None, tiny_train_args(checkpoints["dense"], data, tmp_path / "run", **{
        "parallelism.tp": 2, "parallelism.dp_shard": -1, "lora.enabled": True}))
    with pytest.raises(UserError, match=r"'parallelism.tp' = 2 with \[lora\] is not available"):
        preflight(cfg, world_size=2)

"""Pipeline parallelism (titanite/parallel/pipeline_runner.py): every layout against its own
single-process run of the same config (losses <= 1e-5, grad norms and the MoE balancing loss
<= 1e-4 relative, the Hugging Face export tensor for tensor), checkpoints resumed across pipeline
layouts and schedules, LoRA (its adapters exported from every stage; its dropout resumed exactly),
evaluation and the MoE statistics under pp, and the refusals.

The models have 4 layers, so schedules with two stages per rank get one layer per stage on 2
ranks; untied embeddings (pipeline parallelism refuses tied ones).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY_MOE, make_hf_checkpoint, read_metrics
from tests.parallel.test_distributed import (  # noqa: F401
    _tensors,
    args_for,
    assert_same_export,
    assert_same_run,
    data,
    resume_dir,
    single_process,
    torchrun,
)
from titanite.core.config import load_config
from titanite.core.errors import UserError
from titanite.parallel.pipeline_layout import SCHEDULES, balanced_split
from titanite.run.preflight import preflight


@pytest.fixture(scope="module")
def dense4(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("dense4"), tiny_tokenizer_dir, seed=4, num_hidden_layers=4)


@pytest.fixture(scope="module")
def moe4(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("moe4"), tiny_tokenizer_dir, seed=5, num_hidden_layers=4,
                              **TINY_MOE, output_router_logits=True, router_aux_loss_coef=0.05)


@pytest.fixture(scope="module")
def moe_mixed4(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Layers 0 and 1 dense: pipeline rank 0 of pp = 2 holds no MoE layer."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("moe-mixed4"), tiny_tokenizer_dir, seed=6, num_hidden_layers=4,
                              **TINY_MOE, mlp_only_layers=[0, 1], output_router_logits=True,
                              router_aux_loss_coef=0.05)


GLOBAL = {"model.aux_loss_scope": "global_batch"}
LAYOUTS = {
    # name: (checkpoint fixture, ranks, overrides)
    "1f1b": ("dense4", 2, {"parallelism.pp": 2}),
    "hf_gpipe": ("dense4", 2, {"model.spec": "hf", "parallelism.pp": 2, "parallelism.pp_schedule": "GPipe"}),
    "interleaved_ac_documents": ("dense4", 2, {"parallelism.pp": 2, "parallelism.pp_schedule": "Interleaved1F1B",
                                               "parallelism.activation_checkpoint": "full",
                                               "data.packing": "documents"}),
    "moe_zbv": ("moe4", 2, {"parallelism.pp": 2, "parallelism.pp_schedule": "ZBVZeroBubble"}),
    "moe_dualpipev": ("moe4", 2, {"parallelism.pp": 2, "parallelism.pp_schedule": "DualPipeV", **GLOBAL}),
    "hf_moe_interleaved_zb": ("moe4", 2, {"model.spec": "hf", "parallelism.pp": 2,
                                          "parallelism.pp_schedule": "InterleavedZeroBubble", **GLOBAL}),
    "lora_zbv": ("dense4", 2, {"lora.enabled": "true", "lora.rank": 4, "parallelism.pp": 2,
                               "parallelism.pp_schedule": "ZBVZeroBubble"}),
    # rank 0's stage has no MoE layer: it still logs the step's balancing values
    "moe_stage_without_moe": ("moe_mixed4", 2, {"parallelism.pp": 2, **GLOBAL}),
    "hf_lora_moe": ("moe4", 2, {"model.spec": "hf", "lora.enabled": "true", "lora.rank": 4, "parallelism.pp": 2}),
    "looped_bfs_split": ("dense4", 2, {"parallelism.pp": 2, "parallelism.pp_schedule": "LoopedBFS",
                                       "parallelism.pp_split": "[1, 1, 1, 1]"}),
    "pp_fsdp_ac": ("dense4", 4, {"parallelism.pp": 2, "parallelism.activation_checkpoint": "selective"}),
    # the transformers model's wrapper is the FSDP root under pp (the stages enter through it)
    "hf_pp_hsdp_ac": ("dense4", 4, {"model.spec": "hf", "parallelism.pp": 2, "parallelism.dp_replicate": 2,
                                    "parallelism.activation_checkpoint": "full"}),
    "hf_pp_tp": ("dense4", 4, {"model.spec": "hf", "parallelism.pp": 2, "parallelism.tp": 2}),
    "pp_tp": ("dense4", 4, {"parallelism.pp": 2, "parallelism.tp": 2,
                            "parallelism.pp_schedule": "Interleaved1F1B"}),
    "moe_pp_ep": ("moe4", 4, {"parallelism.pp": 2, "parallelism.ep": 2, **GLOBAL,
                              "parallelism.activation_checkpoint": "full"}),
    # the recomputation in backward runs under its own micro-batch's cp layout
    "hf_moe_pp_cp_ac_documents": ("moe4", 4, {"model.spec": "hf", "parallelism.pp": 2, "parallelism.cp": 2,
                                              "parallelism.activation_checkpoint": "full",
                                              "data.packing": "documents"}),
}


def _params(layouts: dict) -> list:
    return [pytest.param(n, marks=[pytest.mark.slow] if layouts[n][1] > 2 else []) for n in layouts]


@pytest.mark.parametrize("layout", _params(LAYOUTS))
def test_pipeline_layout_matches_single_process(layout, request, tmp_path, data):
    fixture, ranks, extra = LAYOUTS[layout]
    hf = request.getfixturevalue(fixture)
    reference = {k: v for k, v in extra.items() if not k.startswith("parallelism.")}
    single_process(args_for(hf, data, tmp_path / "ref", 5, **reference))
    proc = torchrun(ranks, args_for(hf, data, tmp_path / "run", 5, **extra))
    assert_same_run(tmp_path / "ref", tmp_path / "run", [1, 2, 3, 4, 5])
    if "lora.enabled" in extra:  # the adapters, gathered from both stages into one peft folder
        assert_same_tensors(tmp_path / "ref" / "adapter", tmp_path / "run" / "adapter")
    else:
        assert_same_export(tmp_path / "ref" / "hf", tmp_path / "run" / "hf")
    assert "pipeline: pp=2" in proc.stderr  # the layout the run really used
    if fixture.startswith("moe") and ranks == 2:
        # One data-parallel rank: the expert-load statistics cover the same tokens as the
        # single process's, assembled from both stages' layers.
        for ref, run in zip(read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "run")):
            moe = [k for k in ref if k.startswith("moe/")]
            assert len(moe) >= 7 and set(moe) <= set(run)
            for key in moe:
                assert run[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key


def test_checkpoints_resume_across_pipeline_layouts(dense4, data, tmp_path):
    """pp = 2 (1F1B) saves; pp = 1 resumes it; pp = 1's checkpoint resumes on pp = 2 under ZBV
    (other stages, two per rank). Every resumed step equals the uninterrupted run."""
    single_process(args_for(dense4, data, tmp_path / "ref", 5, **{"checkpoint.interval": 2,
                                                                  "checkpoint.keep_latest": 0}))
    torchrun(2, args_for(dense4, data, tmp_path / "pp", 5, **{"parallelism.pp": 2, "checkpoint.interval": 2,
                                                              "checkpoint.keep_latest": 0}))
    assert_same_run(tmp_path / "ref", tmp_path / "pp", [1, 2, 3, 4, 5])
    one = resume_dir(tmp_path / "pp", 2, tmp_path / "one")
    single_process(args_for(dense4, data, one, 5))
    assert_same_run(tmp_path / "ref", one, [3, 4, 5])
    zbv = resume_dir(tmp_path / "ref", 2, tmp_path / "zbv")
    proc = torchrun(2, args_for(dense4, data, zbv, 5, **{"parallelism.pp": 2,
                                                         "parallelism.pp_schedule": "ZBVZeroBubble"}))
    assert "resumed from" in proc.stderr
    assert_same_run(tmp_path / "ref", zbv, [3, 4, 5])
    assert_same_export(tmp_path / "ref" / "hf", zbv / "hf")


def test_lora_dropout_under_pp_resumes_exactly(dense4, data, tmp_path):
    """Each stage seeds its adapters' dropout from (step, micro-batch, rank, stage): a run
    resumed from step 2 draws the masks the uninterrupted one drew."""
    extra = {"lora.enabled": "true", "lora.rank": 4, "lora.dropout": 0.1, "parallelism.pp": 2,
             "parallelism.pp_schedule": "Interleaved1F1B"}
    torchrun(2, args_for(dense4, data, tmp_path / "full", 4, **extra, **{"checkpoint.interval": 2,
                                                                         "checkpoint.keep_latest": 0}))
    resumed = resume_dir(tmp_path / "full", 2, tmp_path / "resumed")
    torchrun(2, args_for(dense4, data, resumed, 4, **extra))
    assert_same_run(tmp_path / "full", resumed, [3, 4])
    assert_same_tensors(tmp_path / "full" / "adapter", resumed / "adapter")


def test_lora_adapter_path_under_pp(dense4, data, tmp_path):
    """Adapters that start from a saved adapter folder: each stage loads its layers' factors
    (the folder is checked whole), and the run equals the single process started from it."""
    lora = {"lora.enabled": "true", "lora.rank": 4}
    single_process(args_for(dense4, data, tmp_path / "first", 2, **lora))
    start = {**lora, "lora.adapter_path": str(tmp_path / "first" / "adapter")}
    single_process(args_for(dense4, data, tmp_path / "ref", 3, **start))
    torchrun(2, args_for(dense4, data, tmp_path / "run", 3, **start, **{"parallelism.pp": 2}))
    assert_same_run(tmp_path / "ref", tmp_path / "run", [1, 2, 3])


def assert_same_tensors(a: Path, b: Path) -> None:
    x, y = _tensors(a), _tensors(b)
    assert x.keys() == y.keys() and x
    for key in x:
        assert (x[key] - y[key]).abs().max().item() <= 1e-5, key


@pytest.mark.parametrize("ranks, layout", [
    (2, {"parallelism.pp_schedule": "Interleaved1F1B"}),
    pytest.param(4, {"parallelism.cp": 2}, marks=pytest.mark.slow),  # each cp rank scores its chunks
])
def test_evaluation_under_pipeline_parallelism(ranks, layout, moe4, data, tmp_path):
    """The held-out loss through the pipeline's stages equals the single process's."""
    extra = {"eval.path": str(data), "eval.interval": 2, "eval.max_batches": 3}
    single_process(args_for(moe4, data, tmp_path / "ref", 4, **extra))
    torchrun(ranks, args_for(moe4, data, tmp_path / "run", 4, **extra, **{"parallelism.pp": 2, **layout}))
    ref = [r for r in read_metrics(tmp_path / "ref") if "eval_loss" in r]
    run = [r for r in read_metrics(tmp_path / "run") if "eval_loss" in r]
    assert [r["step"] for r in ref] == [r["step"] for r in run] == [2, 4]
    for a, b in zip(ref, run):
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6)
        assert b["eval_tokens"] == a["eval_tokens"]


# -- refusals: one message each, before anything is written -----------------------------------

BAD = [
    ({"parallelism.pp": 3}, 4, r"parallelism.pp \(3\) does not divide the world size 4"),
    ({"parallelism.pp": 4, "parallelism.pp_schedule": "Interleaved1F1B"}, 4,
     r"makes 8 stages \(2 per rank\), more than the model's 4 layers"),
    ({"parallelism.pp": 2, "parallelism.pp_schedule": "OneFOneB"}, 2,
     "unknown schedule 'OneFOneB'.*schedules: " + ", ".join(SCHEDULES)),
    ({"parallelism.pp": 4, "training.global_batch_size": 4, "training.batch_size": 2}, 4,
     r"'1F1B' needs at least parallelism.pp \(4\) micro-batches per pipeline pass, got 2"),
    ({"parallelism.pp": 2, "parallelism.pp_schedule": "Interleaved1F1B", "parallelism.pp_microbatches": 3,
      "training.global_batch_size": 6}, 2, r"needs a multiple of parallelism.pp \(2\) micro-batches"),
    ({"parallelism.pp": 2, "parallelism.pp_microbatches": 3}, 2, r"'parallelism.pp_microbatches' \(3\) must divide"),
    ({"parallelism.pp": 2, "parallelism.pp_schedule": "DualPipeV", "parallelism.pp_microbatches": 2}, 2,
     r"'DualPipeV' needs at least one per stage \(4\), in multiples of parallelism.pp \(2\), micro-batches"),
    ({"parallelism.pp": 2, "parallelism.pp_schedule": "ZBVZeroBubble", "parallelism.pp_stages_per_rank": 3}, 2,
     r"'parallelism.pp_stages_per_rank' \(3\): pp_schedule 'ZBVZeroBubble' runs exactly 2 stages per rank"),
    ({"parallelism.pp": 2, "parallelism.pp_split": "[3, 2]"}, 2, r"pp_split' \[3, 2\] must list 2 stages"),
    ({"parallelism.pp_split": "[2, 2]"}, 1, r"pp_split' \[2, 2\] is set but parallelism.pp = 1"),
    ({"parallelism.pp": 0}, 2, r"'parallelism.pp' must be > 0, got 0"),
    ({"parallelism.pp": 2, "parallelism.pp_schedule": "ZBVZeroBubble"}, 4,
     r"'ZBVZeroBubble' splits the backward into input and weight gradients, which FSDP \(data-parallel ranks: 2"),
]


@pytest.mark.parametrize("overrides, world, message", BAD)
def test_bad_pipeline_settings_are_refused(overrides, world, message, dense4, data, tmp_path):
    with pytest.raises(UserError, match=message):  # the values when loaded, the rest in preflight
        preflight(load_config(None, args_for(dense4, data, tmp_path / "run", 2, **overrides)), world_size=world)
    assert not (tmp_path / "run").exists()


def test_a_pipeline_rank_without_adapters_is_refused(moe_mixed4, data, tmp_path):
    cfg = load_config(None, args_for(moe_mixed4, data, tmp_path / "run", 2, **{
        "parallelism.pp": 2, "lora.enabled": "true", "lora.target_modules": '["experts.gate_up_proj"]'}))
    with pytest.raises(UserError, match=r"pipeline rank 0 holds layers 0-1, where lora.target_modules adapts nothing"):
        preflight(cfg, world_size=2)


def test_tied_embeddings_are_refused_with_one_message(tmp_path, tiny_tokenizer_dir, data):
    """From the command line: exit 2, the reason on stderr, no output folder."""
    tied = make_hf_checkpoint(tmp_path / "tied", tiny_tokenizer_dir, num_hidden_layers=4, tie_word_embeddings=True)
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0"}
    cmd = [sys.executable, "-m", "titanite.train", *args_for(tied, data, tmp_path / "run", 2, **{"parallelism.pp": 2})]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "not supported together with tied input and output embeddings" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_stages_are_balanced_by_cost():
    assert balanced_split([1.0] * 8, 4) == [2, 2, 2, 2]
    # A head that costs two layers: the last stage takes fewer layers, the most loaded stage is as
    # light as any split can make it.
    sizes = balanced_split([1.0] * 10, 4, last=2.0)
    assert sizes == [3, 3, 3, 1]
    assert balanced_split([1.0] * 5, 5) == [1] * 5

"""Context parallelism (parallelism.cp) on CPU with gloo.

The attention op's context-parallel form against the reference on the whole sequence (values
and gradients, causal and packed documents); training under cp = 2 and 4, alone and with FSDP,
TP and EP, both backends, dense and MoE, plain and packed, against an uninterrupted single
process (losses within 1e-5, grad norms 1e-4, the same export); a checkpoint saved under cp = 2
resumed by one process; and the activations each rank keeps at cp = 2 against cp = 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, read_metrics
from tests.parallel.test_distributed import (  # noqa: F401
    _env,
    args_for,
    assert_same_export,
    assert_same_run,
    data,
    dense,
    layout_params,
    moe,
    resume_dir,
    run_layout,
    single_process,
    torchrun,
)
from titanite.core.config import load_config
from titanite.core.errors import UserError
from titanite.parallel.context import local_index
from titanite.run.trainer import Trainer

DOCS = {"data.packing": "documents"}


def test_local_index_is_a_balanced_permutation():
    for cp in (1, 2, 4):
        parts = [local_index(32, cp, r) for r in range(cp)]
        assert sorted(int(i) for p in parts for i in p) == list(range(32))
        # causal work: every rank's queries see the same number of keys in total
        assert len({int((p + 1).sum()) for p in parts}) == 1


def _workers(script: str, nproc: int, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "tests" / "fixtures" / "context_parallel_worker.py"), script, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_over_the_split_sequence_equals_the_reference(cp):
    """Every rank's outputs and q/k/v gradients equal the reference attention's on the whole
    sequence (fp32), for causal rows and for packed documents that cross the chunk borders."""
    out = _workers("attention", cp)
    lines = [line for line in out.splitlines() if line.startswith("attention")]
    assert len(lines) == 2 * cp  # each rank: causal and packed
    for line in lines:
        errors = [float(x) for x in line.split()[3:]]
        assert max(errors) <= 1e-5, line


# -- training against one process ------------------------------------------------------------

LAYOUTS = {
    # name: (checkpoint fixture, ranks, overrides)
    "cp2": ("dense", 2, {"parallelism.cp": 2}),
    # with held-out evaluation every 2 steps: its loss is of whole sequences too
    "cp2_docs_hf_eval": ("dense", 2, {"parallelism.cp": 2, "model.spec": "hf", "eval.interval": 2, **DOCS}),
    "cp2_moe_docs_ac": ("moe", 2, {"parallelism.cp": 2, "parallelism.activation_checkpoint": "full", **DOCS}),
    "cp2_hf_moe": ("moe", 2, {"parallelism.cp": 2, "model.spec": "hf", "parallelism.activation_checkpoint": "selective"}),
    "cp2_lora": ("dense", 2, {"parallelism.cp": 2, "lora.enabled": "true", "lora.rank": 4, "lora.alpha": 8, **DOCS}),
    "cp4_docs": ("dense", 4, {"parallelism.cp": 4, **DOCS}),
    "cp4_hf_moe": ("moe", 4, {"parallelism.cp": 4, "model.spec": "hf"}),
    "cp2_fsdp2_hf_docs": ("dense", 4, {"parallelism.cp": 2, "parallelism.dp_shard": 2, "model.spec": "hf", **DOCS}),
    "cp2_hsdp2": ("dense", 4, {"parallelism.cp": 2, "parallelism.dp_replicate": 2, "parallelism.dp_shard": 1}),
    "cp2_tp2": ("dense", 4, {"parallelism.cp": 2, "parallelism.tp": 2, **DOCS}),
    "cp2_ep2_moe": ("moe", 4, {"parallelism.cp": 2, "parallelism.dp_shard": 2, "parallelism.ep": 2}),
}


@pytest.mark.parametrize("layout", layout_params(LAYOUTS))
def test_layout_matches_single_process(layout, request, tmp_path, data):
    extra = LAYOUTS[layout][2]
    if "eval.interval" in extra:
        extra = {**extra, "eval.path": data}
    proc = run_layout({layout: (*LAYOUTS[layout][:2], extra)}, layout, request, tmp_path, data)
    assert f"cp={extra['parallelism.cp']}" in proc.stderr
    if "eval.path" in extra:
        evals = [[(r["step"], r["eval_loss"], r["eval_tokens"]) for r in read_metrics(tmp_path / d) if "eval_loss" in r]
                 for d in ("ref", "run")]
        assert [s for s, _, _ in evals[1]] == [2, 4, 5]
        for (_, ref_loss, ref_tokens), (_, loss, tokens) in zip(*evals, strict=True):
            assert tokens == ref_tokens and loss == pytest.approx(ref_loss, rel=1e-5)


def test_checkpoint_from_cp2_resumes_on_one_process(tmp_path, moe, data):
    """Checkpoints do not depend on cp: a cp = 2 run's step-2 checkpoint continues on one process
    with the losses of the uninterrupted single-process run."""
    extra = {"model.spec": "hf", **DOCS}
    single_process(args_for(moe, data, tmp_path / "ref", 5, **extra))
    torchrun(2, args_for(moe, data, tmp_path / "cp2", 5, **extra, **{"parallelism.cp": 2, "checkpoint.interval": 2,
                                                                       "checkpoint.keep_latest": 0}))
    out = resume_dir(tmp_path / "cp2", 2, tmp_path / "one")
    single_process(args_for(moe, data, out, 5, **extra))
    assert_same_run(tmp_path / "ref", out, [3, 4, 5])
    assert_same_export(tmp_path / "ref" / "hf", out / "hf")


def test_activation_memory_per_rank_halves_at_cp2():
    """The bytes autograd keeps for the backward (unique storages) of one forward at S = 2048 on
    each rank of cp = 2, against the same model's forward of the whole sequence in one process:
    about half, plus the gathered keys and values (no mask: on the CPU a chunk's attention over
    its key prefix is two flash calls merged). Measured 0.545 on both ranks."""
    out = _workers("memory", 2)
    ratios = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("memory")]
    assert len(ratios) == 2
    for ratio in ratios:
        assert 0.45 < ratio < 0.6, out


@pytest.mark.parametrize("overrides, message", [
    ({"parallelism.cp": 2, "data.seq_len": 30}, "multiple of 2 x parallelism.cp = 4"),
    ({"parallelism.cp": 2, "parallelism.tp": 2, "data.seq_len": 36}, "x tp"),
    ({"parallelism.cp": 0}, "parallelism.cp"),
    ({"parallelism.cp": 2, "parallelism.compile": "true"}, "parallelism.compile"),
])
def test_bad_context_parallel_settings_are_refused(overrides, message, tmp_path):
    opts = {"job.output_dir": tmp_path / "out", "data.path": tmp_path / "x.jsonl", **overrides}
    with pytest.raises(UserError, match=message):
        load_config(None, [f"--{k}={v}" for k, v in opts.items()])


def test_dynamic_rope_under_cp_is_refused(dense):
    """Dynamic RoPE needs the longest position of a whole sequence, which no cp rank sees: it
    stops before anything runs."""
    from titanite.plan import estimate

    cfg = load_config(None, [f"--model.hf_path={dense}", "--parallelism.cp=2", "--data.seq_len=64",
                             "--model.rope_scaling={rope_type = 'dynamic', factor = 2.0}"])
    with pytest.raises(UserError, match="'dynamic' RoPE scaling: dynamic scaling depends on the longest position"):
        estimate(cfg, 2)


def test_cp_that_does_not_divide_the_world_is_refused():
    from titanite.core.config import ParallelismConfig
    from titanite.parallel.mesh import ParallelDims

    with pytest.raises(UserError, match=r"cp \(3\) x tp \(1\) = 3 does not divide the world size 4"):
        ParallelDims.resolve(ParallelismConfig(cp=3), 4)
    assert ParallelDims.resolve(ParallelismConfig(cp=2), 4).dp_shard == 2


def test_tiny_long_config_trains_with_cp2_as_one_process(tmp_path):
    """configs/qwen3-4b-instruct-2507-long-tiny.toml (chat SFT, packed 2048-token sequences,
    cp = 2 on 2 ranks, selective checkpointing, evaluation) trains, and its losses and held-out
    losses equal the same config's on one process (cp = 1)."""
    from tests.conftest import make_hf_checkpoint
    from tests.fixtures.chat import make_chat_tokenizer, toy_conversations, write_jsonl

    base = make_hf_checkpoint(tmp_path / "base", make_chat_tokenizer(tmp_path / "tok"), max_position_embeddings=2048)
    chats = write_jsonl(tmp_path / "chat.jsonl", toy_conversations(40))
    config = str(REPO / "configs" / "qwen3-4b-instruct-2507-long-tiny.toml")
    common = [f"--model.hf_path={base}", f"--data.path={chats}", f"--eval.path={chats}", "--metrics.progress_bar=off"]
    Trainer(load_config(config, [*common, f"--job.output_dir={tmp_path / 'one'}", "--parallelism.cp=1"])).train()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "titanite.train",
           "--config", config, *common, f"--job.output_dir={tmp_path / 'cp2'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=_env())
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "context parallel: 2 ranks split every 2048-token sequence" in proc.stderr
    assert_same_run(tmp_path / "one", tmp_path / "cp2", [1, 2, 3, 4])
    evals = [[r["eval_loss"] for r in read_metrics(tmp_path / d) if "eval_loss" in r] for d in ("one", "cp2")]
    assert len(evals[0]) == 2 and evals[1] == pytest.approx(evals[0], rel=1e-5)

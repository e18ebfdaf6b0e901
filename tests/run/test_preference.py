"""Preference training (training.objective = 'dpo') beyond TRL's numbers (test_preference_trl.py):
the reference kinds agree with each other, layouts agree with one process, a resumed run repeats
the uninterrupted one bit for bit and passes over a corrupt checkpoint, held-out pairs are
evaluated under TRL's names with eval_ in front, the exports load, and bad input stops with one
message and exit code 2.

Oracles: the live reference for the precomputed one; a separate frozen copy of the base for
LoRA's adapters-off reference; one process for 2-rank FSDP, tensor parallel and expert parallel;
the uninterrupted run for resume; transformers and peft for the exports.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, make_hf_checkpoint, make_tiny_tokenizer, read_metrics, run_cli, stop_after
from tests.fixtures.chat import make_chat_tokenizer, write_jsonl
from tests.fixtures.preference import make_pair_models, write_pair_data
from tests.fixtures.reliability import _corrupt_flip
from titanite.core.config import load_config
from titanite.core.errors import UserError
from titanite.run.trainer import Trainer

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preference")
    tok = make_chat_tokenizer(root / "tok")
    models = make_pair_models(root, tok)
    data = write_pair_data(root / "data")
    return {"tok": tok, "dense": models["dense"][0], "dense_ref": models["dense"][1], "moe": models["moe"][0],
            "moe_ref": models["moe"][1], **data}


def dpo_args(world: dict[str, Path], out: Path, kind: str = "dense", form: str = "conversational", steps: int = 3,
             **extra: object) -> list[str]:
    """A few-second DPO run: 2 pairs per micro-batch, 4 per step on any data-parallel layout."""
    opts = {"job.output_dir": out, "model.hf_path": world[kind], "data.path": world[form],
            "data.format": "preference", "training.objective": "dpo", "data.seq_len": 96,
            "training.batch_size": 2, "training.global_batch_size": 4, "training.steps": steps,
            "training.lr": 1e-3, "training.warmup_steps": 0, "training.lr_schedule": "constant",
            "preference.reference_path": world[f"{kind}_ref"], "metrics.log_interval": 1,
            "metrics.peak_tflops": 1.0, "metrics.progress_bar": "off", "checkpoint.interval": 0,
            "checkpoint.export_hf": False}
    opts.update(extra)
    return [f"--{k}={v}" for k, v in opts.items() if v is not None]


def train(args: list[str]) -> list[dict]:
    trainer = Trainer(load_config(None, args))
    trainer.train()
    return read_metrics(Path(trainer.cfg.job.output_dir))


def assert_same(rows: list[dict], expected: list[dict], rel: float = 1e-6, grad_rel: float = 1e-5) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in expected] and rows
    for r, e in zip(rows, expected):
        assert r["loss"] == pytest.approx(e["loss"], rel=rel), r["step"]
        assert r["grad_norm"] == pytest.approx(e["grad_norm"], rel=grad_rel), r["step"]
        for name in METRICS:
            assert r[name] == pytest.approx(e[name], rel=rel, abs=1e-7), (r["step"], name)


# -- the reference kinds ---------------------------------------------------------------------------


def test_precomputed_reference_equals_the_live_one_and_is_kept_beside_the_token_store(world, tmp_path, caplog):
    live = train(dpo_args(world, tmp_path / "live"))
    assert live[0]["rewards/margins"] != 0  # a reference that differs from the policy
    pre = train(dpo_args(world, tmp_path / "pre", **{"preference.reference": "precomputed"}))
    assert_same(pre, live)
    # MFU counts the live reference's forward: a third of the policy's training FLOPs on top
    per_token = [r["mfu"] / r["tokens_per_sec"] for r in (live[0], pre[0])]
    assert per_token[0] / per_token[1] == pytest.approx(4 / 3, rel=1e-9)
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "titanite" / "tokens"
    files = list(cache.glob("*.reference-*.safetensors"))
    assert files, sorted(p.name for p in cache.iterdir())
    caplog.clear()
    caplog.set_level(logging.INFO, logger="titanite")
    again = train(dpo_args(world, tmp_path / "again", **{"preference.reference": "precomputed"}))
    assert "reference log-probabilities read from" in caplog.text
    assert [r["loss"] for r in again] == [r["loss"] for r in pre]


def test_a_precomputed_reference_model_is_freed_before_training(world, tmp_path, monkeypatch):
    import titanite.run.preference.objective as objective

    seen = []
    real = objective.materialize_reference

    def spy(handle, *args):
        real(handle, *args)
        seen.append(weakref.ref(handle.module))

    monkeypatch.setattr(objective, "materialize_reference", spy)
    trainer = Trainer(load_config(None, dpo_args(world, tmp_path / "run", **{"preference.reference": "precomputed",
                                                                              "data.seq_len": 80})))
    try:
        assert len(seen) == 1 and seen[0]() is None  # built, used, and gone
    finally:
        trainer.close()


def test_a_changed_reference_is_not_read_from_the_precomputed_file(world, tmp_path):
    """RoPE scaling changes every log-prob of the same weights: the file of the unscaled reference
    must not serve it."""
    scaled = {"model.rope_scaling": '{rope_type = "linear", factor = 2.0}', "data.seq_len": 88}
    train(dpo_args(world, tmp_path / "plain", **{"preference.reference": "precomputed", "data.seq_len": 88}))
    pre = train(dpo_args(world, tmp_path / "pre", **{"preference.reference": "precomputed", **scaled}))
    live = train(dpo_args(world, tmp_path / "live", **scaled))
    assert_same(pre, live)


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_lora_adapters_off_reference_equals_a_separate_frozen_base(world, tmp_path, spec):
    lora = {"lora.enabled": True, "lora.rank": 4, "model.spec": spec, "training.lr": 1e-2}
    separate = train(dpo_args(world, tmp_path / "separate", **lora, **{"preference.reference_path": world["dense"]}))
    off = train(dpo_args(world, tmp_path / "off", **lora, **{"preference.reference_path": ""}))
    assert separate[0]["loss"] == pytest.approx(0.6931471805599453, rel=1e-6)  # B = 0: policy = reference
    assert separate[-1]["rewards/margins"] != 0  # and then they part
    assert_same(off, separate, rel=1e-6)
    pre = train(dpo_args(world, tmp_path / "pre", **lora, **{"preference.reference_path": "",
                                                              "preference.reference": "precomputed"}))
    assert_same(pre, separate, rel=1e-6)


# -- layouts ---------------------------------------------------------------------------------------


def torchrun(nproc: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "titanite.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("kind, spec, layout", [
    ("dense", "qwen3", {}),  # FSDP2 over 2 ranks
    ("dense", "hf", {"parallelism.tp": 2, "parallelism.dp_shard": 1}),
    ("moe", "qwen3", {"parallelism.ep": 2}),
    ("moe", "hf", {"preference.reference": "precomputed"}),
    ("dense", "qwen3", {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 1}),  # HSDP's replicas
    # context parallelism: each rank holds half of every row; the rows' sums are summed over both
    # (with held-out evaluation every step: its pairs' sums are the whole rows' too)
    ("dense", "hf", {"parallelism.cp": 2, "preference.sft_weight": 0.5, "eval.interval": 1}),
    ("moe", "qwen3", {"parallelism.cp": 2, "preference.reference": "precomputed"}),
])
def test_two_ranks_equal_one_process(world, tmp_path, kind, spec, layout):
    # 2 steps of 4 pairs: the first 8 of the 10 pairs under both layouts (one epoch's whole batches)
    extra = {"model.spec": spec, "data.shuffle": False, "training.steps": 2, **layout}
    if "eval.interval" in extra:
        extra["eval.path"] = world["standard"]
    one = train(dpo_args(world, tmp_path / "one", kind=kind, form="standard",
                         **{k: v for k, v in extra.items() if not k.startswith("parallelism")}))
    torchrun(2, dpo_args(world, tmp_path / "two", kind=kind, form="standard", **extra))
    two = read_metrics(tmp_path / "two")
    assert_same([r for r in two if "loss" in r], [r for r in one if "loss" in r], rel=1e-5, grad_rel=1e-4)
    if "eval.interval" in extra:
        evals = [[r for r in rows if "eval_loss" in r] for rows in (two, one)]
        assert len(evals[1]) == 2
        for mine, theirs in zip(*evals, strict=True):
            for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_rewards/accuracies"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key


def test_activation_checkpointing_and_accumulation_change_nothing(world, tmp_path):
    # 2 steps: the first 8 pairs in either micro-batch size (one epoch's whole batches)
    plain = train(dpo_args(world, tmp_path / "plain", steps=2, **{"data.shuffle": False}))
    other = train(dpo_args(world, tmp_path / "ac", steps=2, **{"data.shuffle": False, "training.batch_size": 1,
                                                       "parallelism.activation_checkpoint": "full"}))
    assert_same(other, plain, rel=1e-6, grad_rel=1e-6)


# -- resume ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"preference.reference": "precomputed", "lora.enabled": True,
                                        "preference.reference_path": "", "lora.dropout": 0.1}],
                         ids=["live", "lora-precomputed"])
def test_resume_repeats_the_uninterrupted_run_exactly(world, tmp_path, extra):
    full = train(dpo_args(world, tmp_path / "full", steps=4, **extra))
    head = stop_after(Trainer(load_config(None, dpo_args(world, tmp_path / "cut", steps=4, **extra))), 2)
    rows = train(dpo_args(world, tmp_path / "cut", steps=4, **extra))
    assert head + [r["loss"] for r in rows if r["step"] > 2] == [r["loss"] for r in full]
    resumed = {r["step"]: r for r in rows}
    for r in full[2:]:
        assert all(resumed[r["step"]][m] == r[m] for m in METRICS), r["step"]


def test_a_corrupt_checkpoint_is_passed_over(world, tmp_path, capsys):
    full = train(dpo_args(world, tmp_path / "full", steps=4))
    out = tmp_path / "run"
    train(dpo_args(world, out, steps=3, **{"checkpoint.interval": 1}))
    _corrupt_flip(out / "checkpoints" / "step-3")
    rows = train(dpo_args(world, out, steps=4, **{"checkpoint.interval": 1}))
    assert [r["loss"] for r in rows] == [r["loss"] for r in full]


# -- evaluation and exports ------------------------------------------------------------------------


def test_eval_equals_the_training_step_it_would_be_and_the_export_loads(world, tmp_path):
    """lr = 0 and the whole data one batch: the held-out pass over the same pairs, in padded batches
    of 4, must give step 1's numbers (the loss with its SFT term, every reward metric)."""
    import transformers

    out = tmp_path / "run"
    n = len(Path(world["conversational"]).read_text().splitlines())
    rows = train(dpo_args(world, out, steps=1, **{
        "eval.path": world["conversational"], "eval.batch_size": 4, "checkpoint.export_hf": True,
        "preference.sft_weight": 0.5, "training.lr": 0.0, "training.batch_size": n, "training.global_batch_size": n}))
    (row,) = rows
    assert row["eval_pairs"] == n
    for name in ("loss", *METRICS):
        assert row[f"eval_{name}"] == pytest.approx(row[name], rel=1e-6, abs=1e-7), name
    assert row["tokens_per_sec"] > 0 and row["mfu"] > 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(model(ids).logits).all()


def test_lora_run_exports_a_peft_adapter(world, tmp_path):
    import peft
    import transformers

    out = tmp_path / "run"
    train(dpo_args(world, out, steps=2, **{"lora.enabled": True, "lora.rank": 4, "preference.reference_path": "",
                                            "checkpoint.export_hf": True, "training.lr": 1e-2}))
    base = transformers.AutoModelForCausalLM.from_pretrained(world["dense"])
    adapted = peft.PeftModel.from_pretrained(base, out / "adapter")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        changed = adapted(ids).logits
        with adapted.disable_adapter():
            plain = adapted(ids).logits
    assert not torch.allclose(changed, plain)  # the adapter learned something, and peft reads it


# -- bad input -------------------------------------------------------------------------------------


def refused(args: list[str], *fragments: str) -> str:
    proc = run_cli("train", *args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in proc.stderr, (f, proc.stderr[-3000:])
    return proc.stderr


def test_a_row_without_rejected_names_its_line(world, tmp_path):
    rows = [json.loads(line) for line in Path(world["standard"]).read_text().splitlines()]
    del rows[2]["rejected"]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    refused(dpo_args(world, tmp_path / "out", form="standard", **{"data.path": bad}), f"{bad}:3", "'rejected'")
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_prompt_that_fills_max_length_is_refused_or_skipped(world, tmp_path):
    rows = [json.loads(line) for line in Path(world["standard"]).read_text().splitlines()]
    rows[0]["prompt"] = "the model reads tokens " * 40
    bad = write_jsonl(tmp_path / "long.jsonl", rows)
    args = dpo_args(world, tmp_path / "out", form="standard", **{"data.path": bad, "data.seq_len": 64})
    refused(args, f"{bad}:1", "leaves no room for the completion", "data.seq_len = 64")
    skipped = train(args + ["--data.on_malformed=skip"])
    assert skipped[0]["data_malformed"] == 1


def test_a_reference_of_another_architecture_or_tokenizer_is_refused(world, tmp_path):
    other = make_hf_checkpoint(tmp_path / "other", world["tok"], hidden_size=64)
    refused(dpo_args(world, tmp_path / "a", **{"preference.reference_path": other}), "another architecture",
            "hidden_size")
    retok = make_hf_checkpoint(tmp_path / "retok", make_tiny_tokenizer(tmp_path / "plain-tok"))
    refused(dpo_args(world, tmp_path / "b", **{"preference.reference_path": retok}), "differs from the run's tokenizer")


@pytest.mark.parametrize("overrides, fragment", [
    ({"data.format": "chat"}, "data.format = 'preference'"),
    ({"training.objective": "lm"}, "training.objective = 'dpo'"),
    ({"preference.reference": "none"}, "compares the policy with a reference"),
    ({"preference.beta": 0.0}, "'preference.beta' must be > 0"),
    ({"preference.loss_type": "robust", "preference.label_smoothing": 0.5}, "[0, 0.5)"),
    ({"preference.loss_type": "dpo"}, "'sigmoid'"),
    ({"data.packing": "documents"}, "one sequence per row"),
    ({"lora.enabled": True, "lora.adapter_path": "/somewhere", "preference.reference_path": ""}, "lora.adapter_path"),
])
def test_config_mistakes_name_the_key(world, tmp_path, overrides, fragment):
    with pytest.raises(UserError) as e:
        load_config(None, dpo_args(world, tmp_path / "out", **overrides))
    assert fragment in str(e.value)


# -- the DPO config and its tiny twin --------------------------------------------------------------


def test_dpo_config_and_its_tiny_twin_share_one_structure():
    import tomllib

    full, tiny = (tomllib.loads((REPO / "configs" / f"qwen3-4b-instruct-2507-{n}.toml").read_text())
                  for n in ("dpo", "dpo-tiny"))
    assert {s: sorted(t) for s, t in full.items()} == {s: sorted(t) for s, t in tiny.items()}
    assert full["training"]["objective"] == "dpo" and full["lora"]["enabled"]
    load_config(str(REPO / "configs" / "qwen3-4b-instruct-2507-dpo.toml"))  # valid as written


def test_tiny_dpo_config_trains_on_conversational_pairs(world, tmp_path):
    import peft
    import transformers

    out = tmp_path / "run"
    proc = run_cli("train", "--config", "configs/qwen3-4b-instruct-2507-dpo-tiny.toml",
                   f"--model.hf_path={world['dense']}", f"--data.path={world['conversational']}",
                   f"--eval.path={world['conversational']}", f"--job.output_dir={out}", "--metrics.progress_bar=off")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 2
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]  # it learns the preference
    assert "eval_rewards/accuracies" in rows[-1]
    base = transformers.AutoModelForCausalLM.from_pretrained(world["dense"])
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, out / "adapter").eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")(ids).logits
    assert (adapted - merged).abs().max().item() <= 1e-5

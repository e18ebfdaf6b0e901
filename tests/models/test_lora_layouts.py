"""LoRA under parallelism, activation checkpointing and compile, each against one plain process.

Every layout (FSDP2, HSDP, tensor and expert parallel, on either backend, 2 or 4 gloo ranks)
trains the same losses, merged export and adapter factors as one process on the same global
batch, and a 2-rank checkpoint resumes on one rank; activation checkpointing with compile trains
the losses of the plain run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import read_metrics
from tests.fixtures.lora import lora_args
from titanite.core.config import load_config
from titanite.run.trainer import Trainer

pytest_plugins = ["tests.fixtures.lora"]


LAYOUTS = {
    # name: (base, ranks, overrides)
    "fsdp": ("dense", 2, {}),
    "hf_fsdp_experts": ("moe", 2, {"model.spec": "hf"}),
    "ep": ("moe", 2, {"parallelism.ep": 2}),
    "tp": ("dense", 2, {"parallelism.tp": 2}),
    "hf_tp": ("dense", 2, {"model.spec": "hf", "parallelism.tp": 2}),
    "ep_tp": ("moe", 4, {"parallelism.ep": 2, "parallelism.tp": 2}),
    "hf_hsdp_checkpointing": ("dense", 4, {"model.spec": "hf", "parallelism.dp_replicate": 2,
                                           "parallelism.activation_checkpoint": "full"}),
    "fsdp_ep_checkpointing": ("moe", 4, {"parallelism.ep": 2, "parallelism.activation_checkpoint": "selective"}),
}


def layout_args(base: Path, data: Path, out: Path, **extra) -> list[str]:
    """8 sequences per step on any number of ranks (2 per micro-batch per rank)."""
    return lora_args(base, data, out, steps=4, **{"training.batch_size": 2, "training.global_batch_size": 8,
                                                   "checkpoint.interval": 2, **extra})


@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.slow] if LAYOUTS[n][1] > 2 else [])
                                    for n in LAYOUTS])
def test_layout_matches_one_process(layout, bases, data, tmp_path):
    from tests.parallel.test_distributed import assert_same_export, assert_same_run, torchrun

    kind, ranks, extra = LAYOUTS[layout]
    single = {k: v for k, v in extra.items() if not k.startswith("parallelism.")}
    Trainer(load_config(None, layout_args(bases[kind], data, tmp_path / "ref", **single))).train()
    proc = torchrun(ranks, layout_args(bases[kind], data, tmp_path / "run", **extra))
    if "parallelism.ep" in extra:
        assert "on this rank (ep=2)" in proc.stderr + proc.stdout
    assert_same_run(tmp_path / "ref", tmp_path / "run", [1, 2, 3, 4])
    assert_same_export(tmp_path / "ref" / "hf", tmp_path / "run" / "hf")
    # The factors, gathered from every layout's shards into peft's layout. AdamW divides each
    # element's step by its own gradient scale, so an element whose gradient is near zero moves by
    # up to ~lr on fp32 reduction-order noise alone: the factors are held to a tenth of one step
    # (lr 1e-2), the merged weights above (what the model computes with) to 1e-5.
    ref, run = (load_file(tmp_path / d / "adapter" / "adapter_model.safetensors") for d in ("ref", "run"))
    assert ref.keys() == run.keys()
    assert all(ref[k].shape == run[k].shape and (ref[k] - run[k]).abs().max().item() <= 1e-3 for k in ref)
    if layout == "fsdp":  # resharding resume: the 2-rank checkpoint at step 2, continued on 1 rank
        from tests.parallel.test_distributed import resume_dir

        out = resume_dir(tmp_path / "run", 2, tmp_path / "one")
        Trainer(load_config(None, layout_args(bases[kind], data, out, **single))).train()
        assert_same_run(tmp_path / "ref", out, [3, 4])


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_checkpointing_and_compile_train_the_same_adapters(bases, data, tmp_path, spec):
    Trainer(load_config(None, lora_args(bases["moe"], data, tmp_path / "ref", steps=3, **{"model.spec": spec}))).train()
    Trainer(load_config(None, lora_args(bases["moe"], data, tmp_path / "run", steps=3,
                                        **{"model.spec": spec, "parallelism.compile": "true",
                                           "parallelism.activation_checkpoint": "full"}))).train()
    ref, run = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "run")
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 for a, b in zip(ref, run, strict=True))

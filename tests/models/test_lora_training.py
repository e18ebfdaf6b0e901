"""How a LoRA run trains, on both backends.

The base comes out of training bit for bit as it went in, and only the adapters get optimizer
state; a resumed run repeats the uninterrupted one's losses exactly (with dropout too); eval runs
on a LoRA run; bf16 storage and compute agree across the backends; the FLOPs per token that MFU
counts are the matmuls autograd runs (torch's FLOP counter as the oracle); and the 4B LoRA config
and its tiny twin share one structure, the twin training on chat data into an adapter that peft
merges into the run's export.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import make_hf_checkpoint, read_metrics, run_cli, stop_after
from tests.fixtures.lora import base_model, ids, lora_args
from titanite.core.config import load_config
from titanite.run.trainer import Trainer

pytest_plugins = ["tests.fixtures.lora"]


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_base_is_unchanged_and_only_adapters_have_optimizer_state(bases, data, tmp_path, spec):
    trainer = Trainer(load_config(None, lora_args(bases["moe"], data, tmp_path / "run", steps=2,
                                                  **{"model.spec": spec})))
    trainer.train()
    on_disk = load_file(bases["moe"] / "model.safetensors")
    exported = dict(trainer.handle.hf_state_dict())  # the base, without the adapters
    assert exported.keys() == on_disk.keys()
    for key, t in on_disk.items():
        assert torch.equal(exported[key], t), key
    adapters = {id(p) for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert adapters and set(map(id, trainer.optimizer.state)) == adapters
    assert all(not p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_resume_repeats_the_uninterrupted_losses(bases, data, tmp_path, spec):
    args = {"model.spec": spec}
    full = Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "full", steps=5, **args)))
    full.train()
    expected = [r["loss"] for r in read_metrics(tmp_path / "full")]
    head = stop_after(Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "cut", steps=5,
                                                          **args))), 2)
    Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "cut", steps=5, **args))).train()
    tail = [r["loss"] for r in read_metrics(tmp_path / "cut") if r["step"] > 2]
    assert head + tail == expected


def test_dropout_resumes_exactly_too(bases, data, tmp_path):
    args = {"lora.dropout": 0.1}
    Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "full", steps=4, **args))).train()
    expected = [r["loss"] for r in read_metrics(tmp_path / "full")]
    head = stop_after(Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "cut", steps=4,
                                                          **args))), 2)
    Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "cut", steps=4, **args))).train()
    assert head + [r["loss"] for r in read_metrics(tmp_path / "cut") if r["step"] > 2] == expected


def test_eval_runs_on_a_lora_run(bases, data, tmp_path):
    out = tmp_path / "run"
    Trainer(load_config(None, lora_args(bases["dense"], data, out, steps=2,
                                        **{"eval.path": data, "eval.max_batches": 2}))).train()
    rows = read_metrics(out)
    assert any("eval_loss" in r or "eval/loss" in r for r in rows), rows[-1]


def test_bf16_base_and_compute_train_alike_on_both_backends(bases, data, tmp_path):
    """bf16 storage and compute (the 4B config's setting) on the MoE model, both backends: the
    expert adapters fold in the base's dtype outside autocast on both, so the backends run the
    same operations in the same dtypes and agree as closely as in fp32."""
    losses = {}
    for spec in ("qwen3", "hf"):
        out = tmp_path / spec
        Trainer(load_config(None, lora_args(bases["moe"], data, out, steps=3, **{
            "model.spec": spec, "lora.base_dtype": "bf16", "training.mixed_precision": "bf16"}))).train()
        losses[spec] = [r["loss"] for r in read_metrics(out)]
        base = load_file(bases["moe"] / "model.safetensors")
        exported = load_file(out / "hf" / "model.safetensors")
        assert all(t.dtype == torch.bfloat16 for t in exported.values())
        assert exported.keys() == base.keys()
    for a, b in zip(losses["qwen3"], losses["hf"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a)


@pytest.mark.parametrize("spec,targets", [("qwen3", '["all-linear"]'), ("qwen3", '["q_proj", "v_proj"]'),
                                          ("hf", '["all-linear"]')])
def test_lora_flops_per_token_are_the_matmuls_autograd_runs(bases, data, tmp_path, spec, targets):
    """MFU counts what a LoRA step computes: torch's FLOP counter over one forward + backward
    of the dense model equals the count's matmul part (the counter does not see CPU attention,
    whose FLOPs are the count's attention term)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load_config(None, lora_args(bases["dense"], data, tmp_path / "run",
                                      **{"model.spec": spec, "lora.target_modules": targets}))
    trainer = Trainer(cfg)
    a, s = trainer.handle.args, ids().shape[1]
    attention = 12 * a.num_layers * a.num_heads * a.head_dim * s
    batch = {"input_ids": ids(), "position_ids": torch.arange(s).expand(2, s), "labels": ids()}
    with FlopCounterMode(display=False) as counter:
        out = trainer.handle.forward_train(batch)
        out.loss_sum.backward()
    trainer.close()
    per_token = counter.get_total_flops() / (2 * s)
    assert per_token == pytest.approx(trainer.handle.flops_per_token(s) - attention, rel=1e-9)


# -- the LoRA config and its tiny twin ------------------------------------------------------------

def test_lora_config_and_its_tiny_twin_share_one_structure():
    import tomllib

    from tests.conftest import REPO

    full, tiny = (tomllib.loads((REPO / "configs" / f"qwen3-4b-instruct-2507-{n}.toml").read_text())
                  for n in ("lora", "lora-tiny"))
    assert {s: sorted(t) for s, t in full.items()} == {s: sorted(t) for s, t in tiny.items()}
    assert full["lora"]["enabled"] and full["data"]["chat_loss"] == "assistant"
    load_config(str(REPO / "configs" / "qwen3-4b-instruct-2507-lora.toml"))  # valid as written


def test_tiny_lora_config_trains_on_chat_data(tmp_path):
    from peft import PeftModel

    from tests.fixtures.chat import make_chat_tokenizer, toy_conversations, write_jsonl

    base = make_hf_checkpoint(tmp_path / "base", make_chat_tokenizer(tmp_path / "tok"))
    chats = write_jsonl(tmp_path / "chat.jsonl", toy_conversations(4))
    out = tmp_path / "run"
    proc = run_cli("train", "--config", "configs/qwen3-4b-instruct-2507-lora-tiny.toml",
                   f"--model.hf_path={base}", f"--data.path={chats}", f"--eval.path={chats}",
                   f"--job.output_dir={out}", "--metrics.progress_bar=off")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainable of" in proc.stderr  # the parameter counts at start-up
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert any(k.startswith("eval") for r in rows for k in r)
    peft_model = PeftModel.from_pretrained(base_model(base), out / "adapter")
    with torch.no_grad():
        merged = base_model(out / "hf")(ids()).logits
        assert (peft_model.eval()(ids()).logits - merged).abs().max().item() <= 1e-5

"""Training a tiny Qwen3-MoE with the normal trainer: telemetry and aux loss in metrics.jsonl, and
resume with the auxiliary-loss-free balancing bias against the uninterrupted run (the oracle)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_MOE, make_hf_checkpoint, read_metrics, stop_after, tiny_train_args
from titanite.checkpoint import training_state
from titanite.core.config import ModelConfig, load_config
from titanite.models.qwen3.moe import moe_layers
from titanite.models.spec import get_spec
from titanite.run.trainer import Trainer

MOE = dict(TINY_MOE, num_experts=8, output_router_logits=True, router_aux_loss_coef=0.01)


@pytest.fixture
def tiny_moe(tmp_path, tiny_tokenizer_dir):
    return make_hf_checkpoint(tmp_path / "tiny-moe", tiny_tokenizer_dir, **MOE)


def moe_args(hf, data, out, **extra):
    return tiny_train_args(hf, data, out, steps=6, **{"model.moe_bias_update_rate": 0.01,
                                                      "checkpoint.interval": 3, **extra})


def biases(model) -> list[torch.Tensor]:
    return [m.router.expert_bias.clone() for _, m in moe_layers(model)]


def test_metrics_carry_aux_loss_and_expert_load(tmp_path, tiny_moe, tiny_data):
    trainer = Trainer(load_config(None, moe_args(tiny_moe, tiny_data, tmp_path / "run")))
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        # aux_loss is what was added to the loss: coef x the unscaled load-balancing loss.
        assert r["aux_loss"] == pytest.approx(0.01 * r["moe/load_balance_loss"], rel=1e-5)
        for i in (0, 1):
            assert 1.0 <= r[f"moe/layer{i}/max_over_mean"] <= 8 / 2
            assert 0 <= r[f"moe/layer{i}/idle_experts"] <= 6
        assert r["moe/max_over_mean"] == max(r["moe/layer0/max_over_mean"], r["moe/layer1/max_over_mean"])
    # The bias moved, and the counters were consumed by the last update.
    assert all(b.abs().sum() > 0 for b in biases(trainer.model))
    assert all(int(m.router.tokens_per_expert.sum()) == 0 for _, m in moe_layers(trainer.model))


def test_resume_with_balancing_bias_reproduces_uninterrupted(tmp_path, tiny_moe, tiny_data):
    full, split = tmp_path / "full", tmp_path / "split"
    uninterrupted = Trainer(load_config(None, moe_args(tiny_moe, tiny_data, full)))
    uninterrupted.train()
    first = Trainer(load_config(None, moe_args(tiny_moe, tiny_data, split)))
    head = stop_after(first, 2)
    saved = biases(first.model)
    # The saved bias changes which experts are chosen, so a resume that lost it would diverge.
    router = moe_layers(first.model)[0][1].router
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_bias = router(x)[2]
        router.expert_bias.zero_()
        without = router(x)[2]
    assert not torch.equal(with_bias, without)

    resumed = Trainer(load_config(None, moe_args(tiny_moe, tiny_data, split)))  # same command
    assert resumed.step == 2
    for a, b in zip(biases(resumed.model), saved, strict=True):
        assert torch.equal(a, b)
    resumed.train()
    assert head + [r["loss"] for r in read_metrics(split)] == [r["loss"] for r in read_metrics(full)]
    for a, b in zip(biases(resumed.model), biases(uninterrupted.model), strict=True):
        assert torch.equal(a, b)
    # The final checkpoint holds the same bias (DCP saves the persistent buffer).
    model = get_spec("qwen3").build(ModelConfig(hf_path=str(tiny_moe))).module
    model.to_empty(device="cpu")
    training_state.load(training_state.latest_checkpoint(split / "checkpoints"), model, None)
    for a, b in zip(biases(model), biases(uninterrupted.model), strict=True):
        assert torch.equal(a, b)

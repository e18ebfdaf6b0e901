"""model.aux_loss_scope = 'global_batch': the load-balancing loss counted over the whole
optimizer step (titanite/models/moe_balance.py).

The oracle is transformers' own model run on the step's concatenated global batch, with the
loss written out here from its router logits (per layer N_E x sum_i f_i p_i, averaged over
layers): titanite's step over 4 micro-batches gives the same loss, balance loss and every
gradient (routers included), with and without activation checkpointing, on both backends. Then
2 ranks x 2 micro-batches (alone, with EP, with cp) and 2 pipeline stages (with activation
checkpointing, with EP) equal that single process over 5 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import (
    TINY_MOE,
    assert_grads_match,
    make_hf_checkpoint,
    read_metrics,
    tiny_train_args,
    transformers_model,
)
from tests.parallel.test_distributed import assert_same_run, data, torchrun  # noqa: F401
from titanite.core.config import load_config
from titanite.core.errors import UserError
from titanite.kernels import IGNORE_INDEX
from titanite.run import lm_step
from titanite.run.trainer import Trainer

COEF = 0.05  # large enough that the balance term moves the gradients well above fp32 noise
GLOBAL = {"model.aux_loss_scope": "global_batch", "training.batch_size": 2, "training.global_batch_size": 8,
          "checkpoint.interval": 0}


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("moe-balance"), tiny_tokenizer_dir, seed=3, **TINY_MOE,
                              output_router_logits=True, router_aux_loss_coef=COEF)


def reference_step(hf: Path, batches: list[dict[str, torch.Tensor]]):
    """transformers on the concatenated batch: (model with gradients, CE mean, balance loss)."""
    model = transformers_model(hf).train()
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    out = model(input_ids=ids, position_ids=torch.cat([b["position_ids"] for b in batches]),
                output_router_logits=True, use_cache=False)
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    per_layer = []
    for logits in out.router_logits:  # [T, E] per MoE layer
        probs = logits.float().softmax(-1)
        chosen = F.one_hot(probs.topk(k, dim=-1).indices, E).sum(1).float()  # [T, E]
        f, p = chosen.mean(0), probs.mean(0)  # f sums to k over the experts
        per_layer.append(E * (f.detach() * p).sum())
    balance = torch.stack(per_layer).mean()
    (ce + COEF * balance).backward()
    return model, ce.detach(), balance.detach()


@pytest.mark.parametrize("spec, checkpointing", [("qwen3", "none"), ("qwen3", "full"), ("hf", "selective")])
def test_global_batch_step_equals_one_batch_reference(spec, checkpointing, moe, data, tmp_path):
    args = tiny_train_args(moe, data, tmp_path / "run", steps=1, **GLOBAL, **{
        "model.spec": spec, "parallelism.activation_checkpoint": checkpointing})
    trainer = Trainer(load_config(None, args))
    try:
        assert trainer.accum == 4
        batches = [trainer.loader.next_batch() for _ in range(trainer.accum)]
        total, aux, stats = lm_step.accumulate(trainer.ctx, batches)
        reference, ce, balance = reference_step(moe, batches)
        assert float(total) == pytest.approx(float(ce), rel=1e-6, abs=1e-6)
        assert float(aux) == pytest.approx(COEF * float(balance), rel=1e-6)
        assert float(stats["moe/balance_global"]) == pytest.approx(float(balance), rel=1e-6)
        assert_grads_match(trainer.model, reference, tol=1e-6)
    finally:
        trainer.close()


def test_global_and_micro_scopes_differ_and_both_are_logged(moe, data, tmp_path):
    """The same run at either scope logs both values (equal between the runs at step 1, as the
    weights are); the losses trained on differ, and so do the runs' later steps."""
    runs = {}
    for scope in ("micro_batch", "global_batch"):
        out = tmp_path / scope
        Trainer(load_config(None, tiny_train_args(moe, data, out, steps=3, **{**GLOBAL, "model.aux_loss_scope": scope}))
                ).train()
        runs[scope] = read_metrics(out)
    micro, glob = runs["micro_batch"][0], runs["global_batch"][0]
    for key in ("moe/balance_micro", "moe/balance_global", "loss"):
        assert micro[key] == pytest.approx(glob[key], rel=1e-6), key
    assert micro["moe/balance_micro"] != pytest.approx(micro["moe/balance_global"], rel=1e-3)
    assert micro["aux_loss"] == pytest.approx(COEF * micro["moe/load_balance_loss"], rel=1e-6)
    assert glob["aux_loss"] == pytest.approx(COEF * glob["moe/balance_global"], rel=1e-6)
    assert runs["micro_batch"][2]["loss"] != pytest.approx(runs["global_batch"][2]["loss"], rel=1e-7)


LAYOUTS = {
    "dp2": (2, {}),
    "dp2_ep2_ac": (2, {"parallelism.ep": 2, "parallelism.activation_checkpoint": "full"}),
    "hf_dp2_cp2": (4, {"model.spec": "hf", "parallelism.cp": 2}),
    # 2 pipeline stages x 4 micro-batches: each stage trains its layer's share, with the counts of
    # the other stage's layer (and of every micro-batch) from the counting pass
    "pp2_ac": (2, {"parallelism.pp": 2, "parallelism.activation_checkpoint": "full"}),
    "hf_pp2_ep2": (4, {"model.spec": "hf", "parallelism.pp": 2, "parallelism.ep": 2}),
}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.slow] if LAYOUTS[name][0] > 2 else [])
                                    for name in LAYOUTS])
def test_global_batch_on_ranks_equals_one_process(layout, moe, data, tmp_path):
    """2 data-parallel ranks x 2 micro-batches each: the counts are summed over both, so every
    step's loss, balance loss and gradient norm equal the single process's 4 micro-batches."""
    ranks, extra = LAYOUTS[layout]
    reference = {k: v for k, v in extra.items() if not k.startswith("parallelism.")}
    Trainer(load_config(None, tiny_train_args(moe, data, tmp_path / "ref", steps=5, **GLOBAL, **reference))).train()
    torchrun(ranks, tiny_train_args(moe, data, tmp_path / "run", steps=5, **GLOBAL, **extra))
    assert_same_run(tmp_path / "ref", tmp_path / "run", [1, 2, 3, 4, 5])
    rows = zip(read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "run"))
    for ref, run in rows:
        assert run["moe/balance_global"] == pytest.approx(ref["moe/balance_global"], rel=1e-5)
        assert run["moe/balance_micro"] == pytest.approx(ref["moe/balance_micro"], rel=1e-5)


def test_global_batch_without_router_logits_is_refused(tmp_path, tiny_tokenizer_dir, data):
    hf = make_hf_checkpoint(tmp_path / "m", tiny_tokenizer_dir, **TINY_MOE, output_router_logits=False)
    with pytest.raises(UserError, match="output_router_logits = false, so the load-balancing loss is not trained"):
        Trainer(load_config(None, tiny_train_args(hf, data, tmp_path / "out", **GLOBAL)))
    assert not (tmp_path / "out").exists()


def test_scope_on_a_dense_model_warns(tmp_path, tiny_hf, data, caplog):
    trainer = Trainer(load_config(None, tiny_train_args(tiny_hf, data, tmp_path / "out", **GLOBAL)))
    trainer.close()
    assert "model.aux_loss_scope = 'global_batch' has no effect: the model is dense" in caplog.text


def test_the_estimate_counts_the_counting_forward(moe, data, tmp_path):
    """With accumulation, 'global_batch' runs one more forward per micro-batch: a third more of
    the step's FLOPs (forward + backward = 3 forwards); without accumulation, none."""
    from titanite.plan import estimate

    def flops(**extra) -> float:
        return estimate(load_config(None, tiny_train_args(moe, data, tmp_path / "x", **{**GLOBAL, **extra})), 1
                        ).flops_per_step

    micro = flops(**{"model.aux_loss_scope": "micro_batch"})
    assert flops() == pytest.approx(micro * 4 / 3, rel=1e-9)
    assert flops(**{"training.global_batch_size": 2}) == pytest.approx(micro / 4, rel=1e-9)  # one micro-batch

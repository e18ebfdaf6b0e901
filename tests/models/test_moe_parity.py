"""Native Qwen3-MoE against transformers' Qwen3MoeForCausalLM (the oracle), from real HF folders:
logits, gradients, the auxiliary loss, the routing telemetry and the checkpoint layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

import titanite
from tests.conftest import TINY_MOE, TINY_VOCAB, assert_grads_match, make_hf_checkpoint, transformers_model
from titanite.core.config import ModelConfig
from titanite.models.handle import handle_of
from titanite.models.qwen3.state_dict import Qwen3StateDictAdapter
from titanite.models.spec import get_spec

MOE = dict(TINY_MOE, num_experts=8, norm_topk_prob=False)  # each case states its normalisation
CASES = {
    "norm_topk_false": dict(MOE, norm_topk_prob=False),
    "norm_topk_true": dict(MOE, norm_topk_prob=True),
    "mlp_only_layers": dict(MOE, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[0]),
    "sparse_step_2": dict(MOE, num_hidden_layers=4, decoder_sparse_step=2),
    "top4_of_16": dict(MOE, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
    # 5 tokens, top-1 over 8 experts: at least 3 experts get no token in every layer.
    "top1_idle_experts": dict(MOE, num_experts_per_tok=1),
}
TOL = 1e-5


def load_both(folder):
    return transformers_model(folder), titanite.load_pretrained(folder, spec="qwen3", dtype=torch.float32)


def token_ids(shape, seed=1):
    return torch.randint(0, TINY_VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def idle_experts_per_layer(router_logits: tuple[torch.Tensor, ...], top_k: int, num_experts: int) -> list[int]:
    """From transformers' own router logits: experts chosen by no token, per MoE layer."""
    return [num_experts - len(torch.unique(logits.topk(top_k, dim=-1).indices)) for logits in router_logits]


@pytest.mark.parametrize("case", CASES)
def test_logits_and_grads_match_transformers(tmp_path, case):
    folder = make_hf_checkpoint(tmp_path / case, **CASES[case])
    hf, ours = load_both(folder)
    ids = token_ids((1, 5) if case == "top1_idle_experts" else (2, 17))
    hf_out = hf(ids, output_router_logits=True)
    if case == "top1_idle_experts":
        assert min(idle_experts_per_layer(hf_out.router_logits, 1, 8)) >= 3
    kinds = [type(layer.feed_forward).__name__ for layer in ours.layers]
    hf_kinds = ["MoE" if type(layer.mlp).__name__.endswith("SparseMoeBlock") else "FeedForward"
                for layer in hf.model.layers]
    assert kinds == hf_kinds
    logits = ours(ids)
    assert (logits - hf_out.logits).abs().max().item() <= TOL
    g = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (logits * g).sum().backward()
    (hf_out.logits * g).sum().backward()
    assert_grads_match(ours, hf, TOL)
    if case == "top1_idle_experts":  # experts that saw no token get an exact zero gradient
        experts = ours.layers[0].feed_forward.experts
        idle = experts.w_gate_up.grad.abs().sum((1, 2)) == 0
        assert idle.sum() >= 3 and torch.equal(experts.w_down.grad[idle], torch.zeros_like(experts.w_down.grad[idle]))


def train_batch(ids):
    """A trainer batch: labels are the next tokens, the last position ignored."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).expand_as(ids), "labels": labels}


def mean_cross_entropy(out, batch):
    if out.loss_sum is not None:  # the model computed it through the `loss` op
        return out.loss_sum / (batch["labels"] != -100).sum()
    return F.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def test_aux_loss_and_its_gradients_match_transformers(tmp_path):
    # A coefficient other than the config default, on a model with a dense layer among sparse ones.
    folder = make_hf_checkpoint(tmp_path / "m", **dict(MOE, norm_topk_prob=True), num_hidden_layers=3,
                                mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.05)
    hf, ours = load_both(folder)
    ids = token_ids((2, 17))
    hf_out = hf(ids, labels=ids)  # loss = mean CE (labels shifted inside) + coef * aux_loss
    batch = train_batch(ids)
    out = handle_of(ours).forward_train(batch)
    assert out.aux_loss is not None
    assert abs(out.aux_loss.item() - 0.05 * hf_out.aux_loss.item()) <= 1e-7
    assert out.stats["moe/load_balance_loss"].item() == pytest.approx(hf_out.aux_loss.item(), rel=1e-6)
    ce = mean_cross_entropy(out, batch)
    assert abs((ce + out.aux_loss).item() - hf_out.loss.item()) <= TOL
    (ce + out.aux_loss).backward()
    hf_out.loss.backward()
    assert_grads_match(ours, hf, TOL)


def test_aux_loss_only_when_output_router_logits(tmp_path):
    folder = make_hf_checkpoint(tmp_path / "m", **MOE, router_aux_loss_coef=0.05)  # output_router_logits off
    ours = titanite.load_pretrained(folder)
    out = handle_of(ours).forward_train(train_batch(token_ids((2, 9))))
    assert out.aux_loss is None
    assert out.stats["moe/load_balance_loss"] > 0  # still reported, not trained on


def test_load_telemetry_matches_transformers_router(tmp_path):
    folder = make_hf_checkpoint(tmp_path / "m", **MOE, num_hidden_layers=4, decoder_sparse_step=2)
    hf, ours = load_both(folder)
    ids = token_ids((2, 6))
    with torch.no_grad():
        router_logits = hf(ids, output_router_logits=True).router_logits  # MoE layers 1 and 3
        stats = {k: v.item() for k, v in handle_of(ours).forward_train(train_batch(ids)).stats.items()}
    for layer, logits in zip((1, 3), router_logits, strict=True):
        counts = torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=8).float()
        assert stats[f"moe/layer{layer}/max_over_mean"] == pytest.approx((counts.max() / counts.mean()).item())
        assert stats[f"moe/layer{layer}/idle_experts"] == (counts == 0).sum().item()
    assert not any(k.startswith(("moe/layer0/", "moe/layer2/")) for k in stats)  # dense layers
    assert stats["moe/idle_experts"] == stats["moe/layer1/idle_experts"] + stats["moe/layer3/idle_experts"]
    assert stats["moe/max_over_mean"] == max(stats["moe/layer1/max_over_mean"], stats["moe/layer3/max_over_mean"])


def test_expert_layout_on_meta_matches_the_checkpoint(tmp_path):
    """The adapter's per-expert names and shapes, computed on meta tensors (no data), are
    exactly the tensors transformers wrote."""
    folder = make_hf_checkpoint(tmp_path / "m", **MOE, num_hidden_layers=3, mlp_only_layers=[1])
    model = get_spec("qwen3").build(ModelConfig(hf_path=str(folder))).module  # on meta
    adapter = Qwen3StateDictAdapter(model.args)
    expected = {k: tuple(t.shape) for n, p in model.state_dict().items() for k, t in adapter.to_hf(n, p)}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert expected == on_disk
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in on_disk


def test_random_init_debug_flavor_exports_to_transformers(tmp_path):
    handle = get_spec("qwen3").build(ModelConfig(flavor="debug-moe"))
    model = handle.module
    model.to_empty(device="cpu")
    handle.init_weights(0.02, seed=0)
    assert all(torch.equal(layer.feed_forward.router.expert_bias, torch.zeros(8)) for layer in model.layers)
    out = titanite.save_pretrained(model.eval(), tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.num_experts == 8
    ids = torch.randint(0, 1000, (1, 16))
    assert (hf(ids).logits - model(ids)).abs().max().item() <= TOL


def test_balancing_bias_is_left_out_of_exports_with_a_warning(tmp_path, caplog):
    src = make_hf_checkpoint(tmp_path / "src", **MOE)
    model = titanite.load_pretrained(src)
    assert torch.equal(model.layers[0].feed_forward.router.expert_bias, torch.zeros(8))  # HF load: zero
    with torch.no_grad():
        model.layers[0].feed_forward.router.expert_bias[3] = 0.5
    with caplog.at_level("WARNING", logger="titanite"):
        out = titanite.save_pretrained(model, tmp_path / "out")
    assert "routing bias" in caplog.text
    assert set(load_file(out / "model.safetensors")) == set(load_file(src / "model.safetensors"))

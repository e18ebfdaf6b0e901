"""MoE units: the router's fp32 choice and balancing bias, the default experts path against the
per-expert loop reference, and the published MoE flavors against the released model sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanite import kernels
from titanite.core.config import ModelConfig
from titanite.core.errors import UserError
from titanite.kernels.attach import default_impl
from titanite.kernels.routing import expert_counts
from titanite.models.qwen3.flavors import get_flavor
from titanite.models.qwen3.model import Qwen3
from titanite.models.qwen3.moe import MoE, TopKRouter
from titanite.models.spec import get_spec


def tilted_router(num_experts=8, top_k=2, hidden=32, tokens=1024):
    """A router whose gate favours low-numbered experts (busiest about 1.75x the mean load),
    and its tokens."""
    g = torch.Generator().manual_seed(0)
    router = TopKRouter(hidden, num_experts, top_k, norm_topk_prob=True)
    direction = F.normalize(torch.randn(hidden, generator=g), dim=0)
    tilt = torch.linspace(1, -1, num_experts)[:, None] * direction
    with torch.no_grad():
        router.gate.weight.copy_(0.3 * torch.randn(num_experts, hidden, generator=g) + tilt)
        router.expert_bias.zero_()
    return router, torch.randn(tokens, hidden, generator=g) + direction


def max_over_mean(counts: torch.Tensor) -> float:
    return (counts.max() / counts.float().mean()).item()


def test_router_weights_are_fp32_softmax_of_the_chosen_experts():
    router, x = tilted_router()
    probs, weights, ids = router(x.bfloat16())
    assert probs.dtype == weights.dtype == torch.float32
    expected = torch.softmax(x.bfloat16().float() @ router.gate.weight.t(), dim=-1)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(ids, expected.topk(2, dim=-1).indices)
    chosen = expected.gather(-1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)


def test_bias_balances_a_skewed_router_without_touching_the_weights():
    router, x = tilted_router()
    with torch.no_grad():
        _, _, ids = router(x)
    assert max_over_mean(expert_counts(ids, 8)) > 1.6
    for _ in range(120):  # one "optimizer step" per iteration, the gate itself frozen
        with torch.no_grad():
            router.update_bias(expert_counts(router(x)[2], 8), rate=3e-3)
    with torch.no_grad():
        probs, weights, ids = router(x)
    assert max_over_mean(expert_counts(ids, 8)) < 1.25
    assert abs(router.expert_bias.mean().item()) < 1e-6  # centred
    # The bias only chose the experts: weights are still the unbiased probabilities.
    unbiased = torch.softmax(x @ router.gate.weight.t(), dim=-1).gather(-1, ids)
    torch.testing.assert_close(weights, unbiased / unbiased.sum(-1, keepdim=True))
    assert not torch.equal(ids, probs.topk(2, dim=-1).indices)


def test_bias_update_moves_busy_experts_down_and_idle_ones_up():
    router = TopKRouter(4, 4, 1, norm_topk_prob=False)
    router.expert_bias.zero_()
    router.update_bias(torch.tensor([10, 0, 3, 3]), rate=0.1)  # mean 4
    b = router.expert_bias
    assert b[0] < 0 < b[1] and b[2] > 0 and b[2] == b[3] and abs(b.sum().item()) < 1e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_experts_match_the_loop_reference_with_idle_experts(dtype):
    torch.manual_seed(0)
    layer = MoE(hidden=64, intermediate=32, num_experts=16, top_k=2, norm_topk_prob=True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    layer.router.expert_bias.zero_()
    layer = layer.to(dtype)
    reference = MoE(64, 32, 16, 2, True).to(dtype)
    reference.load_state_dict(layer.state_dict())
    reference.experts.kernel.bind(kernels.implementations("moe.experts")["reference"])
    x = torch.randn(1, 5, 64, dtype=dtype)  # 10 routed rows over 16 experts: >= 6 idle
    g = torch.randn(1, 5, 64, dtype=dtype)
    outs = []
    for m in (layer, reference):
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y * g).sum().backward()
        outs.append((y, xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    assert (layer.last_routing.counts == 0).sum() >= 6
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    (y, gx, gp), (y_ref, gx_ref, gp_ref) = outs
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(gx, gx_ref, **tol)
    for n in gp:
        torch.testing.assert_close(gp[n], gp_ref[n], **tol, msg=n)


def _layer_outputs(layer: MoE, x: torch.Tensor, g: torch.Tensor):
    xi = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(xi)
    (y * g).sum().backward()
    return [y.detach(), xi.grad] + [p.grad for p in layer.parameters()]


def _twin_layers(hidden, intermediate, num_experts, top_k, dtype=torch.float32):
    torch.manual_seed(0)
    layer = MoE(hidden, intermediate, num_experts, top_k, norm_topk_prob=True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    layer.router.expert_bias.zero_()
    twin = MoE(hidden, intermediate, num_experts, top_k, norm_topk_prob=True)
    twin.load_state_dict(layer.state_dict())
    return layer.to(dtype), twin.to(dtype)


@pytest.mark.parametrize("top_k", [1, 3])
def test_gather_dispatch_matches_the_reference_deterministically(top_k):
    """The default dispatch (gathers in both directions) against the reference's indexing:
    identical outputs, gradients equal up to the summation order over the k slots, and it runs
    with deterministic algorithms enforced (its backward has no scatter-add)."""
    layer, reference = _twin_layers(48, 32, 8, top_k)
    reference.dispatcher.kernel.bind(kernels.implementations("moe.dispatch")["reference"])
    assert layer.dispatcher.kernel.impl is None  # unbound: the op's default runs
    assert default_impl("moe.dispatch", "cpu", torch.float32).name == "gather"
    x, g = torch.randn(2, 19, 48), torch.randn(2, 19, 48)
    torch.use_deterministic_algorithms(True)
    try:
        ours = _layer_outputs(layer, x, g)
    finally:
        torch.use_deterministic_algorithms(False)
    ref = _layer_outputs(reference, x, g)
    assert torch.equal(ours[0], ref[0])
    for a, b in zip(ours[1:], ref[1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_experts_run_sizes_grouped_mm_cannot(dtype, caplog):
    """torch._grouped_mm needs 16-byte-aligned rows; at other hidden / expert sizes the default
    experts say so once and compute the same as the loop reference instead of failing in backward."""
    layer, reference = _twin_layers(30, 10, 4, 2, dtype)
    reference.experts.kernel.bind(kernels.implementations("moe.experts")["reference"])
    x, g = torch.randn(1, 7, 30, dtype=dtype), torch.randn(1, 7, 30, dtype=dtype)
    with caplog.at_level("WARNING", logger="titanite"):
        ours = _layer_outputs(layer, x, g)
    assert "multiples of" in caplog.text and "hidden size 30" in caplog.text
    for a, b in zip(ours, _layer_outputs(reference, x, g)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dispatch", ["reference", "gather"])
def test_dispatch_takes_an_empty_batch(dispatch):
    """No tokens (e.g. a rank's empty share) is a valid input: empty output, zero weight grads."""
    layer, _ = _twin_layers(16, 8, 4, 2)
    layer.dispatcher.kernel.bind(kernels.implementations("moe.dispatch")[dispatch])
    y, x_grad, *grads = _layer_outputs(layer, torch.randn(0, 3, 16), torch.randn(0, 3, 16))
    assert y.shape == x_grad.shape == (0, 3, 16)
    assert all(g is None or not g.any() for g in grads)


@pytest.mark.slow
def test_compiled_moe_layer_keeps_the_math():
    """torch.compile over an fp32 MoE layer (grouped_mm's compiled form is bf16-only, so fp32
    experts run outside the graph) gives the eager layer's outputs and gradients."""
    layer, twin = _twin_layers(64, 32, 8, 2)
    x, g = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    eager = _layer_outputs(layer, x, g)
    for a, b in zip(_layer_outputs(torch.compile(twin), x, g), eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def count_params(args) -> tuple[float, float]:
    """(total, activated per token) parameters of the native model built on meta, in billions."""
    with torch.device("meta"):
        model = Qwen3(args)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total / 1e9, (total - experts * (1 - args.num_experts_per_tok / args.num_experts)) / 1e9


@pytest.mark.parametrize("flavor, total, active", [("30B-A3B", 30.5, 3.3), ("235B-A22B", 235.0, 22.0)])
def test_published_moe_flavors_have_the_released_sizes(flavor, total, active):
    """The Qwen3 model cards: 30.5B total / 3.3B activated, and 235B / 22B."""
    args = get_flavor(flavor)
    got_total, got_active = count_params(args)
    assert got_total == pytest.approx(total, rel=0.01)
    assert got_active == pytest.approx(active, rel=0.02)
    assert args.norm_topk_prob and not args.tie_word_embeddings and args.head_dim == 128


def test_debug_moe_flavors_build_sparse_and_dense_layers():
    assert [get_flavor("debug-moe").layer_is_moe(i) for i in range(4)] == [True] * 4
    # decoder_sparse_step 2 makes layers 1 and 3 sparse; mlp_only_layers keeps 3 dense.
    assert [get_flavor("debug-moe-mixed").layer_is_moe(i) for i in range(4)] == [False, True, False, False]


def test_bias_update_rate_on_a_dense_model_is_a_user_error():
    with pytest.raises(UserError, match="model.moe_bias_update_rate"):
        get_spec("qwen3").build(ModelConfig(flavor="debug", moe_bias_update_rate=1e-3))

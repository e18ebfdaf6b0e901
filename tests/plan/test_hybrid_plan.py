"""The planner on Qwen3.5 / Qwen3-Next (titanite/plan/hybrid.py): parameter counts equal the
meta-device model's, a Gated DeltaNet block's activations are what torch keeps in a real fp32
forward on CPU, and the rehearsal agrees at published widths."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.fixtures.startup_probe import _profiled
from titanite.core.config import load_config
from titanite.core.errors import UserError
from titanite.models.qwen3.flavors import FLAVORS, get_flavor
from titanite.models.spec import get_spec
from titanite.plan import estimate
from titanite.plan.counts import layer_activation_elems
from titanite.plan.rehearse import rehearse

HYBRID = [n for n, a in FLAVORS.items() if a.is_hybrid]


def _cfg(flavor: str, *extra: str):
    return load_config(None, [f"--model.flavor={flavor}", "--training.batch_size=1", "--data.seq_len=64", *extra])


@pytest.mark.parametrize("flavor", HYBRID)
def test_parameter_count_is_the_models(flavor):
    cfg = _cfg(flavor)
    numel = sum(p.numel() for p in get_spec("qwen3").build(cfg.model).module.parameters())
    assert estimate(cfg, 1).params == 4 * numel  # fp32, one process: every parameter once


def _live_bytes(prof) -> int:
    """Bytes allocated and not freed while the profiler ran (what the forward left alive)."""
    from torch._C._profiler import _EventType

    total, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            total += node.extra_fields.alloc_size
        stack.extend(node.children)
    return total


# (flavor, B, S): a dense and an MoE (shared expert) Gated DeltaNet block, 2 and 4 chunks per row
BLOCKS = [("debug-qwen3.5", 2, 128), ("debug-qwen3.5", 1, 256), ("debug-qwen3.5-moe", 2, 128)]


@pytest.mark.parametrize("flavor,B,S", BLOCKS)
def test_delta_block_activations_are_what_torch_keeps(flavor, B, S):
    """Layer 0 (Gated DeltaNet) in fp32 on the reference kernels: the bytes its forward leaves
    alive (the kept values and its output, less its input: the same count) within 5% of the
    estimate's per-token values; the coefficients leave out the last chunk's padding and the
    per-sequence states (titanite/plan/hybrid.py)."""
    from titanite.kernels import attach
    from titanite.models.qwen3.model import RotaryEmbedding, TransformerBlock

    a = get_flavor(flavor)
    assert a.layer_is_linear(0)
    torch.manual_seed(0)
    block = TransformerBlock(a, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    attach(block, {}, "cpu", torch.float32, False)
    x = torch.randn(B, S, a.hidden_size, requires_grad=True)
    cos, sin = RotaryEmbedding(a)(torch.arange(S).expand(B, S), torch.float32)
    gc.collect()
    with _profiled() as prof:
        y = block(x, cos, sin)
    measured = _live_bytes(prof)
    planned = layer_activation_elems(a, 0, 1, "none") * B * S * 4
    assert y.requires_grad and abs(planned - measured) <= 0.05 * measured, (planned, measured)


def test_rehearsal_at_published_widths():
    """Qwen3.5-35B-A3B on 8 ranks (FSDP, experts over 8): the real sharded model's states are the
    estimate's."""
    cfg = _cfg("qwen3.5-35B-A3B", "--parallelism.ep=8", "--training.mixed_precision=bf16")
    e = estimate(cfg, 8, on_gloo=False)
    for f in rehearse(cfg, 8):
        assert (f.params, f.grads, f.optimizer) == (e.params, e.grads, e.optimizer)


@pytest.mark.parametrize("extra", ["--parallelism.cp=2", "--parallelism.pp=2", "--parallelism.tp=2"])
def test_layouts_the_hybrid_models_lack_are_refused(extra):
    with pytest.raises(UserError):
        estimate(_cfg("debug-qwen3.5", extra), 2)

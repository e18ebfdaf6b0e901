"""Kernels inside the models: the native model's `loss` op against transformers' logits, the
chunked loss's memory, and titanite's ops serving the transformers backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY_MOE, TINY_VOCAB, counting, make_hf_checkpoint

import titanite
from titanite import kernels
from titanite.kernels import chunked_loss, registry

IGNORE = kernels.IGNORE_INDEX
GATED_DELTANET_OPS = ("gated_delta", "short_conv", "rms_norm_gated")  # Qwen3.5 / Qwen3-Next layers only


def labels_for(ids: torch.Tensor, ignored: int = 5) -> torch.Tensor:
    labels = torch.roll(ids, -1, dims=1)
    labels.view(-1)[torch.randperm(labels.numel(), generator=torch.Generator().manual_seed(0))[:ignored]] = IGNORE
    return labels


@pytest.mark.parametrize("tied", [True, False])
def test_native_loss_op_matches_cross_entropy_of_transformers_logits(tmp_path, tied, monkeypatch):
    """model(ids, labels=...) (the chunked `loss` op, several chunks) against F.cross_entropy on
    the logits of transformers' Qwen3 with the same weights: loss and every gradient."""
    import transformers

    monkeypatch.setattr(chunked_loss, "_CHUNK_ELEMENTS", 7 * TINY_VOCAB)  # 7 tokens per chunk
    folder = make_hf_checkpoint(tmp_path / "hf", tie_word_embeddings=tied)
    native = titanite.load_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    assert kernels.attach(native, {}, "cpu", torch.float32)["loss" if tied else "output.loss"] == "loss:chunked"
    ids = torch.randint(0, TINY_VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    labels = labels_for(ids)
    loss = native(ids, labels=labels)
    want = F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    loss.backward()
    want.backward()
    hf_params = dict(hf.named_parameters())
    checked = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "layers.1.feed_forward.w2.weight": "model.layers.1.mlp.down_proj.weight"}
    if not tied:
        checked["output.weight"] = "lm_head.weight"
    for name, p in native.named_parameters():
        if name in checked:
            torch.testing.assert_close(p.grad, hf_params[checked[name]].grad, rtol=1e-4, atol=1e-6, msg=name)


_PEAK = r"""
import json, sys, torch
from titanite.kernels import chunked_loss, implementations
chunked_loss._CHUNK_ELEMENTS = 1 << 20  # 4 MiB fp32 chunks
torch.manual_seed(0)
h = torch.randn(2048, 16, requires_grad=True)
w = torch.randn(32768, 16, requires_grad=True)
labels = torch.randint(0, 32768, (2048,))
fn = implementations("loss")[sys.argv[1]].fn
# Warm up on tiny inputs: first calls import code (e.g. torch._dynamo for custom ops) that RSS counts.
fn(h[:2].detach().requires_grad_(), w[:64].detach().requires_grad_(), labels[:2] % 64).backward()

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident size (VmHWM) to the current one
before = status("VmRSS")
fn(h, w, labels).backward()
print(json.dumps(status("VmHWM") - before))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_chunked_loss_never_holds_the_logits():
    """Peak memory of forward + backward above the inputs, in a fresh process each: the reference
    holds the 256 MiB [2048, 32768] fp32 logits (and their softmax and gradient); the chunked op
    stays under a quarter of that (one 4 MiB chunk at a time, plus the 2 MiB weight gradient)."""
    logits = 2048 * 32768 * 4
    peaks = {}
    for impl in ("reference", "chunked"):
        out = subprocess.run([sys.executable, "-c", _PEAK, impl], capture_output=True, text=True, check=True,
                             cwd=REPO, env={"OMP_NUM_THREADS": "1", "PATH": ""})
        peaks[impl] = json.loads(out.stdout.splitlines()[-1])
    assert peaks["reference"] > logits
    assert peaks["chunked"] < logits / 4, peaks


HF_ARCHS = {
    "dense_untied": dict(tie_word_embeddings=False),
    # sparse, dense, sparse layers; tied head
    "moe_mixed_tied": dict(TINY_MOE, num_hidden_layers=3, mlp_only_layers=[1], tie_word_embeddings=True),
}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("arch", HF_ARCHS)
def test_transformers_backend_runs_every_titanite_op(tmp_path, scratch_impls, arch, packed):
    """A transformers Qwen3 / Qwen3-MoE with titanite's call sites installed gives unmodified
    transformers' logits, loss and gradients (the loss from the hidden states and the head
    weight, the MoE auxiliary loss from the `moe.router` records), whole sequences and packed
    documents alike; every op's registered kernel ran, at each of its call sites."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from titanite.kernels import block_causal_mask
    from titanite.kernels.hf import install, labels
    from titanite.models.moe_stats import load_balancing_loss

    folder = make_hf_checkpoint(tmp_path / arch, **HF_ARCHS[arch])
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                               experts_implementation="eager")
    cfg = theirs.config
    moe = hasattr(cfg, "num_experts")
    calls: list[str] = []
    for op in registry.OPS:
        counting(op, f"scratch_counting_{op}", scratch_impls, calls)
    install(ours)
    bound = kernels.attach(ours, {op: f"scratch_counting_{op}" for op in registry.OPS}, "cpu", torch.float32)
    qwen3_ops = [op for op in registry.OPS if op not in GATED_DELTANET_OPS and (moe or "moe" not in op)]
    assert set(bound.values()) == {f"{op}:scratch_counting_{op}" for op in qwen3_ops}
    assert bound["model.layers.0.self_attn.q_norm.kernel"] == "rms_norm:scratch_counting_rms_norm"
    assert bound["lm_head.loss"] == "loss:scratch_counting_loss"
    ids = torch.randint(0, TINY_VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    target = labels_for(ids)
    kw = {}
    if packed:
        docs = torch.tensor([[0] * 5 + [1] * 8, [0] * 2 + [1] * 1 + [2] * 10])
        kw = {"attention_mask": block_causal_mask(docs),
              "position_ids": torch.cat([torch.arange(n) for n in (5, 8, 2, 1, 10)]).view(2, 13)}
    torch.testing.assert_close(ours(ids, **kw).logits, theirs(ids, **kw).logits, rtol=1e-5, atol=1e-5)
    calls.clear()
    with labels(target):
        loss = ours(ids, **kw).logits
    # The base model, then the head: transformers' CausalLM cannot pool its aux loss under a 4-D mask.
    out = theirs.model(ids, output_router_logits=moe, **kw)
    logits = theirs.lm_head(out.last_hidden_state)
    ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    if moe:
        records = [m.last_routing for m in ours.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
        aux = load_balancing_loss(records, cfg.num_experts)
        ref_aux = load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
        torch.testing.assert_close(aux, ref_aux, rtol=1e-6, atol=1e-7)
        loss, ref = loss + 3.0 * aux, ref + 3.0 * ref_aux
    loss.backward()
    ref.backward()
    theirs_grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs_grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    layers = cfg.num_hidden_layers
    sparse = [i for i in range(layers) if moe and i not in cfg.mlp_only_layers]
    expected = {"attention": layers, "rms_norm": 4 * layers + 1, "rope": layers, "swiglu": layers - len(sparse),
                "moe.router": len(sparse), "moe.dispatch": len(sparse), "moe.experts": len(sparse), "loss": 1,
                **dict.fromkeys(GATED_DELTANET_OPS, 0)}
    assert {op: calls.count(f"scratch_counting_{op}") for op in registry.OPS} == expected


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_installed_transformers_model_keeps_its_kv_cache_and_refuses_padding(tmp_path, arch):
    """After `install`, decoding with transformers' KV cache (a prompt, several tokens into the
    filled cache, then one) gives unmodified transformers' logits of the whole sequence; a 2-D
    mask with padding, which the installed attention would not apply, is refused."""
    import transformers

    from titanite.kernels.hf import install

    folder = make_hf_checkpoint(tmp_path / arch, **HF_ARCHS[arch])
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                               experts_implementation="eager").eval()
    install(ours)
    ids = torch.randint(0, TINY_VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = transformers.DynamicCache(config=ours.config)
        pieces = [ours(ids[:, a:b], cache=cache, use_cache=True).logits for a, b in ((0, 5), (5, 8), (8, 9))]
        torch.testing.assert_close(torch.cat(pieces, dim=1), theirs(ids).logits, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="padding"):
            ours(ids, attention_mask=torch.tensor([[1] * 9, [0] * 2 + [1] * 7]))
        ours(ids, attention_mask=torch.ones(2, 9, dtype=torch.long))  # no padding: what generate() passes


@pytest.mark.parametrize("spec", ["hf", "qwen3"])
def test_verify_runs_each_implementation_through_the_model_call_sites(spec, scratch_impls):
    """`titanite kernels verify --spec` binds each implementation at its op's call sites in a
    real model of the backend: every built-in that runs here passes in fp32 and bf16, a kernel
    that was called counts its calls, and a wrong one fails."""
    from titanite.models.call_sites import verify_call_sites

    calls: list[str] = []
    counting("swiglu", "scratch_counting_swiglu", scratch_impls, calls)

    def rope_unrotated(q, k, cos, sin):
        return q * 1.0, k * 1.0

    rope_unrotated.__signature__ = registry.signature("rope")
    kernels.register("rope", "scratch_no_rotation")(rope_unrotated)
    scratch_impls.append(("rope", "scratch_no_rotation"))
    rows = verify_call_sites(spec, dtypes=[torch.float32, torch.bfloat16])
    result = {(r.op, r.impl, r.dtype): r.status for r in rows}
    ran = {k: v for k, v in result.items() if v != "skip"}
    assert ran.pop(("rope", "scratch_no_rotation", "float32")) == "FAIL"
    assert ran.pop(("rope", "scratch_no_rotation", "bfloat16")) == "FAIL"
    assert set(ran.values()) == {"pass"}, ran
    for key in [("moe.experts", "grouped_mm", "bfloat16"),
                ("loss", "chunked", "float32"), ("attention", "sdpa", "bfloat16"), ("moe.dispatch", "gather", "float32")]:
        assert key in ran, key
    assert calls.count("scratch_counting_swiglu") == 2  # the one dense layer, once per dtype
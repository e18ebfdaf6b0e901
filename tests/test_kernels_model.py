"""Kernels inside the models: the native model's `loss` op against transformers' logits, the
chunked loss's memory, and titanite's ops serving the transformers backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import titanite
from conftest import REPO, TINY_MOE, TINY_VOCAB, counting, make_hf_checkpoint
from titanite import kernels
from titanite.kernels import chunked_loss, registry

IGNORE = kernels.IGNORE_INDEX


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


@pytest.mark.parametrize("packed", [False, True])
def test_transformers_backend_runs_titanite_attention_and_experts(tmp_path, scratch_impls, packed):
    """A transformers Qwen3-MoE with titanite's ops installed gives transformers' own logits and
    gradients (eager experts, SDPA attention), whole sequences and packed documents alike; the
    registered kernels are the ones that ran."""
    import transformers

    from titanite.kernels.hf import install
    from titanite.kernels import block_causal_mask

    folder = make_hf_checkpoint(tmp_path / "moe", **TINY_MOE)
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                               experts_implementation="eager")
    calls: list[str] = []
    for op in ("attention", "moe.dispatch", "moe.experts"):
        counting(op, f"scratch_counting_{op}", scratch_impls, calls)
    install(ours)
    bound = kernels.attach(ours, {op: f"scratch_counting_{op}" for op in ("attention", "moe.dispatch", "moe.experts")},
                           "cpu", torch.float32)
    assert bound["model.layers.0.self_attn.attention"] == "attention:scratch_counting_attention"
    assert bound["model.layers.1.mlp.experts.experts_kernel"] == "moe.experts:scratch_counting_moe.experts"
    ids = torch.randint(0, TINY_VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    kw = {}
    if packed:
        docs = torch.tensor([[0] * 5 + [1] * 8, [0] * 2 + [1] * 1 + [2] * 10])
        kw = {"attention_mask": block_causal_mask(docs),
              "position_ids": torch.cat([torch.arange(n) for n in (5, 8, 2, 1, 10)]).view(2, 13)}
    g = torch.randn(2, 13, TINY_VOCAB, generator=torch.Generator().manual_seed(3))
    outs = []
    for model in (ours, theirs):
        logits = model(ids, **kw).logits
        (logits * g).sum().backward()
        outs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(grad, outs[1][1][name], rtol=1e-4, atol=1e-5, msg=name)
    assert [calls.count(f"scratch_counting_{op}") for op in ("attention", "moe.dispatch", "moe.experts")] == [2, 2, 2]

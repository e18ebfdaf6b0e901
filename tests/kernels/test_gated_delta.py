"""The Gated DeltaNet references against independent oracles: the chunked gated delta rule
against the token-by-token loop and transformers' Qwen3.5 functions (forward and gradients),
packed documents against each document alone; the short convolution and the gated RMSNorm
against transformers' versions."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from titanite.kernels.reference_delta import gated_delta, gated_delta_recurrent, rms_norm_gated, short_conv

TOL = 1e-5  # fp32, relative to the largest magnitude


def _hf():
    """transformers' Qwen3.5 module, imported inside the tests, never at collection: it imports
    Triton, which must first be imported after test_kernels_triton.py (collected later) sets
    TRITON_INTERPRET=1, else the Triton kernels fail in the interpreter in later tests."""
    return importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def _inputs(B=2, S=100, Hk=2, Hv=4, Dk=16, Dv=12, seed=0, state=True):
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, S, Hk, Dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, S, Hv, Dv, generator=g)
    decay = -torch.rand(B, S, Hv, generator=g) * 0.5
    beta = torch.rand(B, S, Hv, generator=g)
    h0 = torch.randn(B, Hv, Dk, Dv, generator=g) * 0.5 if state else None
    return q, k, v, decay, beta, h0


def _fwd_bwd(fn, args: list, grad_idx: tuple[int, ...], seed: int = 7):
    """(outputs, grads of a fixed random projection of the outputs w.r.t. args[grad_idx])."""
    args = [a.detach().clone().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a for i, a in enumerate(args)]
    outs = fn(*args)
    gen = torch.Generator().manual_seed(seed)
    total = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    grads = torch.autograd.grad(total, [args[i] for i in grad_idx])
    return [o.detach() for o in outs], list(grads)


def _assert_close(got, want, what: str):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, (what, i, a.shape, b.shape)
        assert _rel(a, b) <= TOL, (what, i, _rel(a, b))


def _hf_chunk(q, k, v, g, beta, h0):
    return _hf().torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)


def _hf_recurrent(q, k, v, g, beta, h0):
    return _hf().torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)


@pytest.mark.parametrize("S", [1, 64, 100, 150])
def test_chunked_reference_matches_the_loop_and_transformers(S):
    """S = 1, one full chunk, and sizes no multiple of 64; GQA (value heads twice the key heads),
    an initial state; transformers scales queries by Dk ** -0.5, so the same scale here."""
    q, k, v, g, beta, h0 = _inputs(S=S)
    scale = q.shape[-1] ** -0.5
    grad_idx = (0, 1, 2, 3, 4, 5)
    ours = _fwd_bwd(lambda *a: gated_delta(*a[:5], scale, a[5]), [q, k, v, g, beta, h0], grad_idx)
    loop = _fwd_bwd(lambda *a: gated_delta_recurrent(*a[:5], scale, a[5]), [q, k, v, g, beta, h0], grad_idx)
    for name, oracle in (("loop", loop), ("hf chunk", _fwd_bwd(_hf_chunk, [q, k, v, g, beta, h0], grad_idx)),
                         ("hf recurrent", _fwd_bwd(_hf_recurrent, [q, k, v, g, beta, h0], grad_idx))):
        _assert_close(ours[0], oracle[0], f"forward vs {name}")
        _assert_close(ours[1], oracle[1], f"gradients vs {name}")


def test_without_initial_state_matches_transformers():
    q, k, v, g, beta, _ = _inputs(B=1, S=70, Hk=2, Hv=2, seed=1, state=False)
    scale = q.shape[-1] ** -0.5
    ours = _fwd_bwd(lambda *a: gated_delta(*a, scale), [q, k, v, g, beta], (0, 1, 2, 3, 4))
    theirs = _fwd_bwd(lambda *a: _hf_chunk(*a, None), [q, k, v, g, beta], (0, 1, 2, 3, 4))
    _assert_close(ours[0], theirs[0], "forward")
    _assert_close(ours[1], theirs[1], "gradients")


def _alone(fn, q, k, v, g, beta, h0, lengths: list[int]):
    """Each document of each row run on its own (a row's first from h0, the rest from zeros):
    outputs concatenated, and the state after each row's last document."""
    outs, finals = [], []
    for b in range(q.shape[0]):
        row, start = [], 0
        for i, n in enumerate(lengths):
            sl = slice(start, start + n)
            state = h0[b:b + 1] if i == 0 else torch.zeros_like(h0[b:b + 1])
            o, final = fn(q[b:b + 1, sl], k[b:b + 1, sl], v[b:b + 1, sl], g[b:b + 1, sl], beta[b:b + 1, sl],
                          0.3, state)
            row.append(o)
            start += n
        outs.append(torch.cat(row, 1))
        finals.append(final)
    return torch.cat(outs), torch.cat(finals)


@pytest.mark.parametrize("lengths", [[10, 1, 26], [70, 3, 64, 13], [150]])
def test_packed_documents_compute_what_each_document_computes_alone(lengths):
    """Documents longer than a chunk, of one token, ending on a chunk boundary; forward and
    gradients against each document run alone (through the chunked reference and the loop)."""
    S = sum(lengths)
    q, k, v, g, beta, h0 = _inputs(S=S, seed=2)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1)
    idx = (0, 1, 2, 3, 4, 5)
    packed = _fwd_bwd(lambda *a: gated_delta(*a[:5], 0.3, a[5], docs), [q, k, v, g, beta, h0], idx)
    loop = _fwd_bwd(lambda *a: gated_delta_recurrent(*a[:5], 0.3, a[5], docs), [q, k, v, g, beta, h0], idx)
    alone = _fwd_bwd(lambda *a: _alone(gated_delta, *a, lengths), [q, k, v, g, beta, h0], idx)
    _assert_close(packed[0], alone[0], "forward vs alone")
    _assert_close(packed[1], alone[1], "gradients vs alone")
    _assert_close(packed[0], loop[0], "forward vs loop")
    _assert_close(packed[1], loop[1], "gradients vs loop")


def test_rows_with_different_document_layouts():
    q, k, v, g, beta, h0 = _inputs(S=90, seed=3)
    docs = torch.stack([torch.cat([torch.zeros(5), torch.ones(85)]), torch.cat([torch.zeros(80), torch.ones(10)])])
    o, final = gated_delta(q, k, v, g, beta, 0.3, h0, docs.long())
    o_loop, final_loop = gated_delta_recurrent(q, k, v, g, beta, 0.3, h0, docs.long())
    _assert_close([o, final], [o_loop, final_loop], "forward vs loop")


def test_half_inputs_compute_in_fp32_and_return_v_dtype():
    q, k, v, g, beta, h0 = _inputs(S=40, seed=4)
    o, final = gated_delta(q.half(), k.half(), v.half(), g, beta.half(), 0.3, h0)
    want, _ = gated_delta_recurrent(q.half(), k.half(), v.half(), g, beta.half(), 0.3, h0)
    assert o.dtype == torch.float16 and final.dtype == torch.float32
    assert _rel(o, want) < 2e-3


def test_short_conv_matches_transformers_and_restarts_at_documents():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 37, 20, generator=g), torch.randn(20, 4, generator=g)
    want = _hf().causal_conv1d_fn(x.transpose(1, 2), w, activation="silu").transpose(1, 2)
    assert _rel(short_conv(x, w), want) <= TOL
    lengths = [10, 1, 26]
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1)
    alone = torch.cat([short_conv(part, w) for part in x.split(lengths, dim=1)], 1)
    assert _rel(short_conv(x, w, docs), alone) <= TOL


def test_rms_norm_gated_matches_transformers():
    g = torch.Generator().manual_seed(6)
    norm = _hf().Qwen3_5RMSNormGated(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(48, generator=g))
    for dtype in (torch.float32, torch.bfloat16):
        x, gate = (torch.randn(3, 5, 48, generator=g).to(dtype) for _ in range(2))
        want = norm.to(dtype)(x, gate)
        got = rms_norm_gated(x, gate, norm.weight, 1e-6)
        assert got.dtype == want.dtype and _rel(got, want) <= (TOL if dtype == torch.float32 else 1e-2)

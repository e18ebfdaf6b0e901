"""Built-in implementations checked by `titanite kernels verify` (Triton under TRITON_INTERPRET=1),
verify's own teeth, the custom ops' fake and autograd registrations, and the Triton kernels
compiling for a real GPU target."""

from __future__ import annotations

import json
import os

# Before any Triton kernel module is imported: this file runs the Triton kernels in the
# interpreter, the only way they run on a CPU.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import run_cli  # noqa: E402

from titanite import kernels  # noqa: E402
from titanite.kernels.verify import verify  # noqa: E402

BUILTIN = {("attention", "sdpa"), ("moe.dispatch", "gather"), ("rms_norm", "triton"), ("swiglu", "triton"), ("moe.experts", "grouped_mm"),
           ("moe.experts", "triton"), ("loss", "chunked"), ("gated_delta", "triton")}


@pytest.mark.slow
def test_verify_passes_for_every_builtin_kernel(tmp_path):
    """`make test` runs `titanite kernels verify` over all built-in kernels: every case passes,
    forward and backward, and what cannot run on CPU is listed as skipped with the reason."""
    out = tmp_path / "verify.json"
    proc = run_cli("kernels", "verify", "--device", "cpu", "--json", str(out), env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert not [r for r in rows if r["status"] == "FAIL"]
    passed = {(r["op"], r["impl"], r["dtype"]) for r in rows if r["status"] == "pass"}
    for op, impl in BUILTIN:
        assert (op, impl, "float32") in passed, (op, impl)
    for op in ("rms_norm", "swiglu", "moe.experts", "gated_delta"):
        assert (op, "triton", "float16") in passed
    # Every awkward case ran for the grouped-GEMM kernel: one token, empty expert groups.
    cases = {r["case"] for r in rows if (r["op"], r["impl"], r["status"]) == ("moe.experts", "triton", "pass")}
    assert {"one token", "empty groups, ragged 0/5/0/30", "8 experts, 3 empty"} <= cases
    skipped = {(r["op"], r["impl"], r["dtype"]): r["note"] for r in rows if r["status"] == "skip"}
    assert "tl.dot on bfloat16" in skipped["moe.experts", "triton", "bfloat16"]
    assert "runs on cuda" in skipped["attention", "flex", "float32"]
    assert "runs on cuda" in skipped["gated_delta", "fla", "float32"]
    assert "0 failed" in proc.stdout and "| pass" in proc.stdout


def test_verify_passes_for_the_chunked_gated_delta_kernel():
    """The Triton gated delta rule (chunked forward and backward) in the interpreter: one token,
    grouped value heads with an initial state, packed documents within one chunk and across three
    chunks (a document starting on a chunk boundary)."""
    rows = verify(["gated_delta"], "triton", "cpu", [torch.float32])
    assert len(rows) == 4 and all(r.status == "pass" for r in rows), [(r.case, r.status, r.note) for r in rows]
    assert {r.case for r in rows} >= {"packed docs 10+1+26", "S=150, packed docs 70+1+57+22 / 5+145, initial state"}


def test_fla_gated_delta_says_why_it_cannot_run_here():
    fla = kernels.implementations("gated_delta")["fla"]
    assert "runs on cuda" in fla.unavailable("cpu", torch.float32)
    assert "0 active drivers" in fla.requires("cpu", torch.float32)


class _WrongBackward(torch.autograd.Function):
    """silu(gate) * up forward, with d/dgate missing the silu derivative's second term."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        s = torch.sigmoid(gate)
        return dy * up * s, dy * F.silu(gate)


def test_verify_fails_kernels_that_are_wrong_forward_or_backward(scratch_impls):
    @kernels.register("swiglu", "scratch_swapped")
    def swapped(gate, up):
        return F.silu(up) * gate

    @kernels.register("swiglu", "scratch_bad_grad")
    def bad_grad(gate, up):
        return _WrongBackward.apply(gate, up)

    scratch_impls += [("swiglu", "scratch_swapped"), ("swiglu", "scratch_bad_grad")]
    rows = verify(["swiglu"], "scratch_swapped", "cpu", [torch.float32]) + \
        verify(["swiglu"], "scratch_bad_grad", "cpu", [torch.float32])
    swapped_rows = [r for r in rows if r.impl == "scratch_swapped"]
    assert swapped_rows and all(r.status == "FAIL" and "forward" in r.note for r in swapped_rows)
    bad = [r for r in rows if r.impl == "scratch_bad_grad"]
    assert bad and all(r.status == "FAIL" and r.fwd_err < r.fwd_tol and "backward" in r.note for r in bad)


def test_custom_ops_have_fake_and_autograd_registrations():
    """torch.library.opcheck: schema, fake tensors (torch.compile's tracing), autograd
    registration and AOT dispatch with dynamic shapes, for every titanite custom op."""
    kernels.implementations("loss")  # registers the built-ins
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    counts = torch.tensor([0, 3, 0, 6])
    offsets = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    samples = {
        torch.ops.titanite.rms_norm_triton.default: (r(2, 3, 40), r(40), 1e-6),
        torch.ops.titanite.swiglu_triton.default: (r(3, 37), r(3, 37)),
        torch.ops.titanite.moe_experts_triton.default: (r(9, 16), offsets, r(4, 40, 16) * 0.2, r(4, 16, 20) * 0.2, True),
        torch.ops.titanite.linear_cross_entropy_chunked.default: (r(9, 16), r(50, 16), torch.randint(0, 50, (9,)), -100, 4),
        torch.ops.titanite.gated_delta_triton.default: (
            F.normalize(r(1, 5, 1, 16), dim=-1), F.normalize(r(1, 5, 1, 16), dim=-1), r(1, 5, 2, 16), -torch.rand(1, 5, 2),
            torch.rand(1, 5, 2), 0.25, r(1, 2, 16, 16), torch.tensor([[0, 0, 1, 0, 0]], dtype=torch.int32)),
    }
    for op, args in samples.items():
        args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


def test_bench_times_implementations_side_by_side():
    from titanite.kernels.bench import bench, format_table

    rows = bench(["swiglu"], device="cpu", min_s=0.01, max_iters=3)
    by_impl = {r.impl: r for r in rows}
    assert by_impl["reference"].fwd_bwd_ms > 0 and by_impl["reference"].speedup == 1.0
    assert by_impl["triton"].fwd_ms is None and "interpreter" in by_impl["triton"].note
    assert "vs reference" in format_table(rows)


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from titanite.kernels.triton import gated_delta as D, grouped_gemm as G, norm_act as N
target = GPUTarget("cuda", 90, 32)  # H100 / H200

def build(fn, sig, const):
    sig = {**sig, **{k: "constexpr" for k in const}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=target).asm["cubin"]

for dt in ("fp32", "bf16"):
    p, prec = "*" + dt, ("ieee" if dt == "fp32" else "tf32")
    tiles = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
    i32 = "i32"
    build(N._rms_norm_fwd, {"X": p, "W": p, "Y": p, "RSTD": "*fp32", "R": i32, "D": i32, "eps": "fp32"},
          {"BLOCK_R": 4, "BLOCK_D": 1024})
    build(N._rms_norm_bwd, {"DY": p, "X": p, "W": p, "RSTD": "*fp32", "DX": p, "DW_PART": "*fp32", "R": i32, "D": i32},
          {"BLOCK_R": 4, "BLOCK_D": 1024})
    build(N._swiglu_fwd, {"G": p, "U": p, "Y": p, "N": i32}, {"BLOCK": 1024})
    build(N._swiglu_bwd, {"DY": p, "G": p, "U": p, "DG": p, "DU": p, "N": i32}, {"BLOCK": 1024})
    mm = {"A": p, "B": p, "OFFS": "*i32", "C": p, "GU": p, "E": i32, "N": i32, "K": i32, "s_be": i32, "s_bk": i32, "s_bn": i32}
    build(G._gate_up_swiglu, {"X": p, "W": p, "OFFS": "*i32", "GU": p, "ACT": p, "E": i32, "H": i32, "I": i32,
                              "s_we": i32, "s_wn": i32, "s_wk": i32}, {"PREC": prec, "STORE_GU": True, **tiles})
    for swiglu_bwd in (True, False):
        build(G._grouped_mm, mm, {"PREC": prec, "SWIGLU_BWD": swiglu_bwd, **tiles})
    for from_gu in (True, False):
        build(G._grouped_wgrad, {"DY": p, "X": p, "OFFS": "*i32", "DW": p, "N": i32, "K": i32},
              {"PREC": prec, "X_FROM_GU": from_gu, **tiles})

# The gated delta rule at Qwen3.5's head dims (128), bf16 in, the tiles the launcher picks there;
# the backward's shared memory must fit sm_90's 227 KiB.
p, i32 = "*bf16", "i32"
blocks = {"BT": 64, "BK": 128, "BV": 16, "PREC": "tf32x3"}
seq = {"Q": p, "K": p, "V": p, "G": "*fp32", "BETA": p, "RESET": "*i32"}
dims = {"S": i32, "Hk": i32, "Hv": i32, "Dk": i32, "Dv": i32, "scale": "fp32", "NT": i32}
for write_o, store in ((True, False), (False, True)):
    build(D._fwd, {**seq, "H0": "*fp32", "O": p, "HT": "*fp32", "STATES": "*fp32", **dims},
          {"WRITE_O": write_o, "STORE_STATES": store, **blocks})
sig = {**seq, "STATES": "*fp32", "DO": p, "DHT": "*fp32", **{n: "*fp32" for n in ("DQ", "DK", "DV", "DG", "DBETA", "DH0")}}
sig = {**sig, **dims, **{k: "constexpr" for k in blocks}}
bwd = triton.compile(ASTSource(fn=D._bwd, signature=sig, constexprs=blocks), target=target)
assert bwd.metadata.shared <= 227 * 1024, bwd.metadata.shared
print("compiled")
"""


@pytest.mark.slow
def test_triton_kernels_compile_for_a_gpu():
    """With no GPU here, the interpreter cannot catch what only the compiler rejects (types
    changing in loops, unsupported control flow): every kernel is compiled to a cubin for sm_90
    in fp32 and bf16 with the ptxas that ships with Triton."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def test_gated_delta_kernel_split_into_value_blocks(monkeypatch):
    """Compiled, the kernels cut the value dim into blocks, one program each, and sum the blocks'
    shares of dq, dk, dg, dbeta; the interpreter takes all columns at once unless told: here
    Dv = 40 in blocks of 16 (the last one partial), two chunks, a restart, grouped value heads."""
    from titanite.kernels.reference_delta import gated_delta
    from titanite.kernels.triton import gated_delta as kernels_gd
    from titanite.kernels.triton.delta_ops import reset_flags

    blocks = kernels_gd._blocks
    monkeypatch.setattr(kernels_gd, "_blocks", lambda Dk, Dv: {**blocks(Dk, Dv), "BV": 16})
    g = torch.Generator().manual_seed(3)
    B, S, Hk, Hv, Dk, Dv = 1, 70, 1, 2, 16, 40
    q, k = (F.normalize(torch.randn(B, S, Hk, Dk, generator=g), dim=-1) for _ in range(2))
    v, decay, beta = torch.randn(B, S, Hv, Dv, generator=g), -torch.rand(B, S, Hv, generator=g), torch.rand(B, S, Hv, generator=g)
    h0 = torch.randn(B, Hv, Dk, Dv, generator=g)
    docs = (torch.arange(S) >= 50).long()[None]
    reset = reset_flags(docs, B, S, v.device)
    o, ht, _ = kernels_gd.forward(q, k, v, decay, beta, 0.25, h0, reset)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, decay, beta, h0)]
    ro, rht = gated_delta(*leaves[:5], 0.25, leaves[5], docs)
    do, dht = torch.randn(ro.shape, generator=g), torch.randn(rht.shape, generator=g)
    want = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), leaves)
    got = kernels_gd.backward(do, dht, q, k, v, decay, beta, 0.25, h0, reset)
    for a, b in zip((o, ht, *got), (ro, rht, *want), strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-5

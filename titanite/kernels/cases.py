"""Inputs for `titanite kernels verify` (awkward shapes) and `bench` (realistic shapes).

A case is the op's positional arguments plus which of them get gradients. Verify shapes are
small and deliberately awkward: one token, sizes that are no multiple of any block size (37,
100), expert groups that are empty, ignored labels, packed documents. Bench shapes follow
Qwen3 (MoE: 30B-A3B) on accelerators and are scaled down on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from titanite.kernels.reference_ops import IGNORE_INDEX


@dataclass
class Case:
    name: str
    args: tuple
    grad: tuple[int, ...]  # indices of args that receive gradients


def _rand(shape, dtype, device, scale: float = 1.0, gen: torch.Generator | None = None) -> Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def _cos_sin(B: int, S: int, D: int, dtype, device) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    angles = torch.arange(S, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat((angles, angles), -1).expand(B, S, D)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _documents(lengths: list[int], B: int, device) -> Tensor:
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return ids.expand(B, -1).contiguous().to(device)


def _many_documents(S: int, device) -> Tensor:
    """Two rows [2, S] with different layouts: a document longer than the sdpa implementation's
    groups (128 tokens) and then short ones; many short ones (1 to 9 tokens) and padding."""
    short = [1 + (7 * i) % 9 for i in range(S)]
    first = [S - 40] + short[:6]  # 30 tokens
    first.append(S - sum(first))
    second = short[:next(i for i in range(S) if sum(short[:i + 1]) > S - 30)]
    second.append(S - sum(second))  # padding: a block of its own
    return torch.cat([_documents(first, 1, device), _documents(second, 1, device)])


class _ScaledExperts:
    """A stand-in for `moe.experts` when checking dispatch: expert e maps x to (e + 1) * x +
    tanh(x), so a token sent to the wrong expert, or un-permuted to the wrong slot, shows."""

    def __call__(self, x_sorted: Tensor, counts: Tensor) -> Tensor:
        scale = torch.repeat_interleave(torch.arange(1, counts.shape[0] + 1, device=x_sorted.device), counts)
        return x_sorted * scale.to(x_sorted.dtype).unsqueeze(-1) + torch.tanh(x_sorted)


def _router_inputs(T: int, E: int, K: int, H: int, dtype, device, g) -> tuple[Tensor, Tensor, Tensor]:
    """x [T, H], topk ids [T, K] (distinct per token; experts 0 and E-1 left empty), weights [T, K]."""
    x = _rand((T, H), dtype, device, gen=g)
    scores = torch.rand(T, E - 2, generator=g)
    ids = (scores.topk(K, dim=-1).indices + 1).to(device)
    weights = torch.rand(T, K, generator=g).softmax(-1).to(device, dtype)
    return x, ids, weights


def _moe_weights(E: int, H: int, I: int, dtype, device, g) -> tuple[Tensor, Tensor]:
    return _rand((E, 2 * I, H), dtype, device, H ** -0.5, g), _rand((E, H, I), dtype, device, I ** -0.5, g)


def _experts_case(name: str, counts: list[int], H: int, I: int, dtype, device, g) -> Case:
    c = torch.tensor(counts, dtype=torch.int64, device=device)
    w_gu, w_d = _moe_weights(len(counts), H, I, dtype, device, g)
    return Case(name, (_rand((sum(counts), H), dtype, device, gen=g), c, w_gu, w_d), (0, 2, 3))


def _labels(N: int, V: int, device, g, ignored: int = 0) -> Tensor:
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.randperm(N, generator=g)[:ignored]] = IGNORE_INDEX
    return labels.to(device)


def verify_cases(op: str, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """Small awkward inputs for `op` (a fixed seed: every run checks the same numbers)."""
    g = torch.Generator().manual_seed(1234)

    def r(*shape, scale=1.0):
        return _rand(shape, dtype, device, scale, g)

    if op == "attention":
        return [Case("one token", (r(1, 2, 1, 16), r(1, 1, 1, 16), r(1, 1, 1, 16), 0.25), (0, 1, 2)),
                Case("S=37 GQA 4:2", (r(2, 4, 37, 16), r(2, 2, 37, 16), r(2, 2, 37, 16), 0.25), (0, 1, 2)),
                Case("packed docs 10+1+26", (r(2, 4, 37, 16), r(2, 2, 37, 16), r(2, 2, 37, 16), 0.25,
                                             _documents([10, 1, 26], 2, device)), (0, 1, 2)),
                Case("packed docs, 2 layouts, 300 tokens", (r(2, 4, 300, 16), r(2, 2, 300, 16), r(2, 2, 300, 16),
                                                            0.25, _many_documents(300, device)), (0, 1, 2)),
                # Over a KV cache: the queries are the last positions of the keys.
                Case("decode: 1 query, 9 keys", (r(1, 4, 1, 16), r(1, 2, 9, 16), r(1, 2, 9, 16), 0.25), (0, 1, 2)),
                Case("chunk: 5 queries, 12 keys", (r(2, 4, 5, 16), r(2, 2, 12, 16), r(2, 2, 12, 16), 0.25), (0, 1, 2)),
                # A context-parallel chunk of packed documents: the ids cover the keys.
                Case("chunk over packed docs: 9 queries, 37 keys", (r(2, 4, 9, 16), r(2, 2, 37, 16), r(2, 2, 37, 16),
                                                                   0.25, _documents([10, 1, 26], 2, device)), (0, 1, 2))]
    if op == "rms_norm":
        return [Case(f"x {list(shape)}", (r(*shape), (1.0 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, dtype),
                                         1e-6), (0, 1))
                for shape in ((1, 48), (3, 37, 100), (2, 5, 4, 128))]
    if op == "rope":
        return [Case(f"S={S}", (r(2, 4, S, 16), r(2, 2, S, 16), *_cos_sin(2, S, 16, dtype, device)), (0, 1))
                for S in (1, 37)]
    if op == "swiglu":
        return [Case(f"{list(shape)}", (r(*shape), r(*shape)), (0, 1)) for shape in ((1, 1), (3, 37, 100))]
    if op == "moe.router":
        return [Case(f"T={T} E=8 top2 norm={norm}", (r(T, 48), r(8, 48, scale=0.3), 2, norm), (0, 1))
                for T, norm in ((1, True), (37, False), (37, True))]
    if op == "moe.dispatch":
        cases = []
        for T, K in ((1, 2), (37, 3)):
            x, ids, w = _router_inputs(T, 8, K, 48, dtype, device, g)
            cases.append(Case(f"T={T} top{K} E=8, 2 experts empty", (x, ids, w, 8, _ScaledExperts()), (0, 2)))
        return cases
    if op == "moe.experts":
        return [_experts_case("one token", [0, 1, 0, 0], 48, 40, dtype, device, g),
                _experts_case("empty groups, ragged 0/5/0/30", [0, 5, 0, 30], 48, 40, dtype, device, g),
                _experts_case("8 experts, 3 empty", [7, 0, 19, 1, 0, 33, 2, 0], 48, 40, dtype, device, g)]
    if op == "loss":
        return [Case("one token", (r(1, 48), r(384, 48, scale=0.2), _labels(1, 384, device, g)), (0, 1)),
                Case("N=37 V=1000, 9 ignored", (r(37, 48), r(1000, 48, scale=0.2), _labels(37, 1000, device, g, 9)), (0, 1)),
                Case("all ignored", (r(5, 48), r(384, 48, scale=0.2), _labels(5, 384, device, g, 5)), (0, 1))]
    if op in ("gated_delta", "short_conv", "rms_norm_gated"):
        return _delta_cases(op, r, g, dtype, device)
    raise AssertionError(f"no verify cases for op {op}")


def _delta_cases(op: str, r, g: torch.Generator, dtype: torch.dtype, device) -> list[Case]:
    """Gated DeltaNet ops: one token, S = 37 with value heads twice the key heads, packed documents."""
    docs = _documents([10, 1, 26], 2, device)
    if op == "gated_delta":
        def inputs(B: int, S: int, Hk: int, Hv: int) -> tuple:
            q, k = (F.normalize(torch.randn(B, S, Hk, 16, generator=g), dim=-1).to(device, dtype) for _ in range(2))
            decay = (-torch.rand(B, S, Hv, generator=g)).to(device, torch.float32)
            beta = torch.rand(B, S, Hv, generator=g).to(device, dtype)
            return q, k, r(B, S, Hv, 12), decay, beta, 0.25
        state = _rand((2, 4, 16, 12), torch.float32, device, 0.5, g)
        # Three chunks of 64: documents across chunk boundaries, one ending on one, and a second
        # row laid out otherwise; the first documents start from the initial state.
        long_docs = torch.cat([_documents([70, 1, 57, 22], 1, device), _documents([5, 145], 1, device)])
        return [Case("one token", inputs(1, 1, 2, 2), (0, 1, 2, 3, 4)),
                Case("S=37 value heads 4:2, initial state", (*inputs(2, 37, 2, 4), state), (0, 1, 2, 3, 4, 6)),
                Case("packed docs 10+1+26", (*inputs(2, 37, 2, 4), None, docs), (0, 1, 2, 3, 4)),
                Case("S=150, packed docs 70+1+57+22 / 5+145, initial state",
                     (*inputs(2, 150, 2, 4), state.clone(), long_docs), (0, 1, 2, 3, 4, 6))]
    if op == "short_conv":
        return [Case("one token", (r(1, 1, 40), r(40, 4, scale=0.5)), (0, 1)),
                Case("S=37 C=100", (r(2, 37, 100), r(100, 4, scale=0.5)), (0, 1)),
                Case("packed docs 10+1+26", (r(2, 37, 100), r(100, 4, scale=0.5), docs), (0, 1))]
    return [Case(f"x {list(shape)}", (r(*shape), r(*shape), (1.0 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, dtype),
                                     1e-6), (0, 1, 2))
            for shape in ((1, 48), (3, 37, 100))]


def bench_case(op: str, dtype: torch.dtype, device: torch.device, big: bool) -> list[Case]:
    """Realistic sizes: Qwen3 (MoE: 30B-A3B) when `big` (on an accelerator), a small fraction of
    that on the host CPU. The caller asks the device layer: the model layer's call-site check
    imports this module (through `verify`) and must not reach `titanite.device`."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return _rand(shape, dtype, device, scale, g)

    if op == "attention":
        B, Hq, Hk, S, D = (4, 32, 4, 4096, 128) if big else (1, 8, 2, 512, 64)
        q, k, v = r(B, Hq, S, D), r(B, Hk, S, D), r(B, Hk, S, D)
        docs = _documents([S // 8, S // 2, S - S // 8 - S // 2], B, device)
        return [Case(f"B={B} S={S} Hq={Hq} Hk={Hk} D={D}", (q, k, v, D ** -0.5), (0, 1, 2)),
                Case(f"B={B} S={S}, 3 packed docs", (q, k, v, D ** -0.5, docs), (0, 1, 2))]
    if op == "rms_norm":
        R, D = (16384, 4096) if big else (4096, 1024)
        return [Case(f"[{R}, {D}]", (r(R, D), r(D), 1e-6), (0, 1))]
    if op == "rope":
        B, S, D = (4, 4096, 128) if big else (1, 512, 64)
        return [Case(f"B={B} S={S} D={D}", (r(B, 32, S, D), r(B, 4, S, D), *_cos_sin(B, S, D, dtype, device)), (0, 1))]
    if op == "swiglu":
        N, I = (16384, 6144) if big else (4096, 1024)
        return [Case(f"[{N}, {I}]", (r(N, I), r(N, I)), (0, 1))]
    T, H, I, E, K = (16384, 2048, 768, 128, 8) if big else (2048, 256, 128, 16, 4)
    if op == "moe.router":
        return [Case(f"T={T} H={H} E={E} top{K}", (r(T, H), r(E, H, scale=0.02), K, True), (0, 1))]
    if op == "moe.dispatch":
        x, ids, w = _router_inputs(T, E, K, H, dtype, device, g)
        return [Case(f"T={T} H={H} E={E} top{K}", (x, ids, w, E, _ScaledExperts()), (0, 2))]
    if op == "moe.experts":
        share = torch.rand(E, generator=g) + 0.1  # uneven expert load
        counts = (share / share.sum() * T * K).floor().long()
        counts[0] += T * K - int(counts.sum())
        w_gu, w_d = _moe_weights(E, H, I, dtype, device, g)
        return [Case(f"{T * K} rows H={H} I={I} E={E}", (r(T * K, H), counts.to(device), w_gu, w_d), (0, 2, 3))]
    if op == "loss":
        N, H, V = (8192, 4096, 151936) if big else (512, 128, 151936)
        return [Case(f"N={N} H={H} V={V}", (r(N, H), r(V, H, scale=0.02), _labels(N, V, device, g, N // 10)), (0, 1))]
    raise AssertionError(f"no bench case for op {op}")


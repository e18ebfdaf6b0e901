"""The gated delta rule on CPU: titanite's chunked reference (`gated_delta`, the op's reference)
against transformers' torch_chunk_gated_delta_rule, forward and forward + backward on the same
fp32 inputs, side by side; the table in "Kernels" in docs/performance.md.

    .venv/bin/python benchmarks/gated_delta.py                  # markdown table
    .venv/bin/python benchmarks/gated_delta.py --seq 512 --repeats 2

Both run the same algorithm (chunks of 64, UT transform by a triangular solve), so the ratio
shows the cost of what titanite adds: an explicit query scale, and document restarts (here
one document per row, so no segments; the packed row cuts its documents into segments
first). transformers scales queries by Dk ** -0.5; titanite is given the same scale.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from titanite.kernels.reference_delta import gated_delta  # noqa: E402


def _inputs(B: int, S: int, Hk: int, Hv: int, D: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, S, Hk, D, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, S, Hv, D, generator=g)
    decay = F.logsigmoid(torch.randn(B, S, Hv, generator=g))  # <= 0, as the model's gate
    beta = torch.rand(B, S, Hv, generator=g)
    h0 = torch.randn(B, Hv, D, D, generator=g) * 0.1
    return [q, k, v, decay, beta, h0]


def _time(fn, args, backward: bool, repeats: int) -> float:
    """Best milliseconds of fn(*args) (and its backward) over `repeats` runs after one warm-up: the
    least disturbed by other load on a shared machine."""
    times = []
    for i in range(repeats + 1):
        leaves = [a.detach().requires_grad_(backward) for a in args]
        start = time.perf_counter()
        o, state = fn(*leaves)
        if backward:
            (o.square().sum() + state.square().sum()).backward()
        if i:
            times.append((time.perf_counter() - start) * 1000)
    return min(times)


def main() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    shapes = [("B=1 H=8 D=64", 1, 8, 8, 64),
              ("Qwen3.5 layout scaled down: Hk=4 Hv=8 D=64", 1, 4, 8, 64)]

    def titanite(q, k, v, g, beta, h0):
        return gated_delta(q, k, v, g, beta, q.shape[-1] ** -0.5, h0)

    def hf(q, k, v, g, beta, h0):
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    print(f"{machine()}, {a.threads} threads, fp32, S={a.seq}, best of {a.repeats}\n")
    print("| case | titanite fwd ms | transformers fwd ms | titanite fwd+bwd ms | transformers fwd+bwd ms "
          "| titanite / transformers (fwd+bwd) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, B, Hk, Hv, D in shapes:
        args = _inputs(B, a.seq, Hk, Hv, D)
        with torch.no_grad():
            o1, s1 = titanite(*args)
            o2, s2 = hf(*args)
        err = max((o1 - o2).abs().max().item() / o2.abs().max().item(), (s1 - s2).abs().max().item() / s2.abs().max().item())
        row = [_time(fn, args, bwd, a.repeats) for bwd in (False, True) for fn in (titanite, hf)]
        print(f"| {name} (max rel diff {err:.0e}) | {row[0]:.0f} | {row[1]:.0f} | {row[2]:.0f} | {row[3]:.0f} "
              f"| {row[2] / row[3]:.2f}x |")
    # The packed form: four documents per row, cut into segments and run as one padded batch.
    args = _inputs(1, a.seq, 4, 8, 64)
    docs = torch.arange(a.seq)[None] * 4 // a.seq
    fwd_bwd = _time(lambda *x: gated_delta(*x[:5], 64 ** -0.5, x[5], docs), args, True, a.repeats)
    print(f"\npacked, 4 documents in the row (Hk=4 Hv=8 D=64): titanite fwd+bwd {fwd_bwd:.0f} ms")


if __name__ == "__main__":
    main()

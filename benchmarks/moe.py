"""One MoE layer, forward + backward, tokens/s: titanite's experts implementations against
transformers' own, side by side in one run, on the same weights and tokens.

Default shape: Qwen3-30B-A3B's routing (top-8 of many experts, norm_topk_prob) scaled to a
CPU: hidden and expert sizes 4x smaller (2048 -> 512, 768 -> 192), 64 experts, 1024 tokens per
step (128 routed rows per expert on average, as 128 experts at 2048 tokens).

    .venv/bin/python benchmarks/moe.py --profile                # the docs/performance.md tables
    .venv/bin/python benchmarks/moe.py --experts 128 --tokens 2048 --profile

Rows:
- titanite reference: the `moe.experts` and `moe.dispatch` references (a plain per-expert
  loop; indexing whose backward scatter-adds).
- titanite loop over unbind views: the same loop taking each expert's weights from one
  `unbind` (its backward is a single stack instead of a full-size zero gradient per expert);
  what grouped_mm experts fall back to at sizes _grouped_mm cannot take. Reference dispatch.
- titanite grouped_mm, reference dispatch: torch._grouped_mm experts, reference dispatch.
- titanite grouped_mm (default): torch._grouped_mm experts with the `gather` dispatch (both
  directions of the permutation are gathers), the native model's defaults.
- transformers eager / batched_mm / grouped_mm: Qwen3MoeSparseMoeBlock with that
  experts_implementation.

Each round times every row once, in turn, each in a fresh process after one untimed step (in
one process, the loops' full-size gradient per expert leaves the allocator in a state that
slows whatever runs next), so machine noise hits all rows alike. The table gives each row's
best (least disturbed) wall time and process CPU time (all threads) over the rounds, and
speed ratios from both. transformers batched_mm gathers a weight copy per routed row, so it
is left out where that would exceed --max-gather-gb.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from titanite import kernels
from titanite.models.qwen3.moe import MoE


def loop_over_unbind(x, counts, w_gate_up, w_down):
    inter = w_down.shape[-1]
    outs = []
    for rows, wgu, wd in zip(x.split(counts.tolist()), w_gate_up.unbind(0), w_down.unbind(0)):
        gate_up = rows @ wgu.T
        outs.append((F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ wd.T)
    return torch.cat(outs)


def build_rows(a, dtype):
    cfg = dict(hidden_size=a.hidden, moe_intermediate_size=a.intermediate, num_experts=a.experts,
               num_experts_per_tok=a.top_k, norm_topk_prob=True)
    torch.manual_seed(0)
    rows = {}
    # batched_mm gathers a full weight copy per routed row (meant for a few decode tokens): at
    # training shapes that is tens of GB, so it runs only where that stays small.
    gathered_gb = a.tokens * a.top_k * 3 * a.intermediate * a.hidden * torch.finfo(dtype).bits / 8 / 1e9
    impls = ("eager", "batched_mm", "grouped_mm") if gathered_gb <= a.max_gather_gb else ("eager", "grouped_mm")
    if "batched_mm" not in impls:
        print(f"transformers batched_mm skipped: it would gather {gathered_gb:.1f} GB of expert weights "
              f"per forward (limit --max-gather-gb {a.max_gather_gb})")
    for impl in impls:
        block = Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(**cfg, experts_implementation=impl))
        rows[f"transformers {impl}"] = block
    hf = rows["transformers eager"]
    with torch.no_grad():
        hf.gate.weight.normal_(std=0.02)
        hf.experts.gate_up_proj.normal_(std=0.02)
        hf.experts.down_proj.normal_(std=0.02)
        for name in rows:
            rows[name].load_state_dict(hf.state_dict())
    impls = kernels.implementations("moe.experts")
    dispatch = kernels.implementations("moe.dispatch")
    for name, fn in (("titanite reference", impls["reference"].fn), ("titanite loop over unbind views", loop_over_unbind),
                     ("titanite grouped_mm, reference dispatch", impls["grouped_mm"].fn),
                     ("titanite grouped_mm (default)", impls["grouped_mm"].fn)):
        moe = MoE(a.hidden, a.intermediate, a.experts, a.top_k, norm_topk_prob=True)
        with torch.no_grad():
            moe.router.gate.weight.copy_(hf.gate.weight)
            moe.router.expert_bias.zero_()
            moe.experts.w_gate_up.copy_(hf.experts.gate_up_proj)
            moe.experts.w_down.copy_(hf.experts.down_proj)
        moe.experts.kernel.bind(kernels.registry.Impl("moe.experts", name, fn, None, None, None, __name__))
        # The default dispatch is `gather`; the loops and one grouped row keep the reference's.
        moe.dispatcher.kernel.bind(dispatch["gather" if name.endswith("(default)") else "reference"])
        rows[name] = moe
    order = ["titanite reference", "titanite loop over unbind views", "titanite grouped_mm, reference dispatch",
             "titanite grouped_mm (default)",
             "transformers eager", "transformers batched_mm", "transformers grouped_mm"]
    return {name: rows[name].to(dtype) for name in order if name in rows}


def step(layer, x, g):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    (layer(x) * g).sum().backward()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=192)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = PyTorch's default")
    p.add_argument("--max-gather-gb", type=float, default=2.0,
                   help="run transformers batched_mm only if its per-forward weight gather stays under this")
    p.add_argument("--profile", action="store_true",
                   help="also report each row's summed op CPU time (torch.profiler, 3 steps): the work done, "
                        "much less sensitive to other processes than wall time")
    p.add_argument("--row", default="", help=argparse.SUPPRESS)  # internal: time one row, print JSON
    return p.parse_args(argv)


def inputs(a: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, a.tokens, a.hidden, generator=gen).to(dtype)
    return x, torch.randn(1, a.tokens, a.hidden, generator=gen).to(dtype)


def time_row(a: argparse.Namespace) -> None:
    """Child process: one warm-up step and one timed step of row `a.row`; prints JSON."""
    dtype = getattr(torch, a.dtype)
    layer = build_rows(a, dtype)[a.row]
    x, g = inputs(a, dtype)
    step(layer, x, g)
    t0, c0 = time.perf_counter(), time.process_time()
    step(layer, x, g)
    result = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}
    if a.profile:
        with torch.profiler.profile() as prof:
            for _ in range(3):
                step(layer, x, g)
        ops = prof.key_averages()
        result["op_cpu"] = sum(e.self_cpu_time_total for e in ops) / 3 / 1e6  # s per step
        result["mm_share"] = sum(e.self_cpu_time_total for e in ops if e.key == "aten::mm") / 3 / 1e6 / result["op_cpu"]
    print(json.dumps(result))


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.row:
        time_row(a)
        return
    dtype = getattr(torch, a.dtype)
    rows = build_rows(a, dtype)
    x, _ = inputs(a, dtype)
    # Same weights, same tokens: every row must compute the same layer.
    with torch.no_grad():
        ref = rows["transformers eager"](x).float()
        for name, layer in rows.items():
            err = (layer(x).float() - ref).abs().max().item()
            assert err < (1e-5 if dtype == torch.float32 else 5e-2), (name, err)
    # Each timing runs in a fresh process: the loops' full-size gradient per expert leaves the
    # allocator in a state that measurably slows whatever runs next in the same process.
    wall: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    op_cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    for _ in range(a.rounds):
        for name in rows:
            proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], f"--row={name}"],
                                  capture_output=True, text=True, check=True)
            t = json.loads(proc.stdout.strip().splitlines()[-1])
            wall[name].append(t["wall"])
            cpu[name].append(t["cpu"])
            if a.profile:
                op_cpu[name].append((t["op_cpu"], t["mm_share"]))

    # Best of the rounds: other processes only ever add time, so the minimum is the least noisy.
    best = {name: min(ts) for name, ts in wall.items()}
    cpu_best = {name: min(ts) for name, ts in cpu.items()}
    tps = {name: a.tokens / t for name, t in best.items()}
    best_hf = min((n for n in rows if n.startswith("transformers")), key=cpu_best.get)
    ref = "titanite reference"
    print(f"MoE layer fwd+bwd: {a.tokens} tokens, hidden {a.hidden}, expert intermediate {a.intermediate}, "
          f"{a.experts} experts, top-{a.top_k}, {a.dtype}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
          f"best of {a.rounds} rounds, each timing in a fresh process")
    print()
    print(f"| implementation | wall ms / step | tokens/s | CPU ms / step | speed vs reference (wall / CPU) "
          f"| speed vs {best_hf} (wall / CPU) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in rows:
        print(f"| {name} | {best[name] * 1e3:.0f} | {tps[name]:.0f} | {cpu_best[name] * 1e3:.0f} | "
              f"{best[ref] / best[name]:.2f}x / {cpu_best[ref] / cpu_best[name]:.2f}x | "
              f"{best[best_hf] / best[name]:.2f}x / {cpu_best[best_hf] / cpu_best[name]:.2f}x |")
    if a.profile:
        print()
        print("| implementation | op CPU ms / step (profiler, best round) | share in aten::mm |")
        print("| --- | ---: | ---: |")
        for name in rows:
            work, share = min(op_cpu[name])
            print(f"| {name} | {work * 1e3:.0f} | {share:.0%} |")


if __name__ == "__main__":
    main()

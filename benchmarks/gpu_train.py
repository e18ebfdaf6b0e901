"""The prepared GPU training benchmark: the whole training step, four setups side by side.

Two random-init models, each trained ~30 steps at sequence 4096 in bf16 from the same weights
and the same data (this Python's standard library, the real Qwen3 tokenizer):

- dense: Qwen3 1.7B (the `1.7B` flavor: 28 layers, hidden 2048, 151,936 tied vocabulary);
- moe: a small Qwen3-MoE, 64 experts, top-8 (hidden 1024, 12 layers, expert MLP 384).

Rows, each a fresh `titanite train` process:

- hf: the Transformers backend (`model.spec = "hf"`);
- native: titanite's own model with the default kernels;
- native + compile: `parallelism.compile = true` (each block compiled);
- native + flex + Triton: `attention = "flex"`, Triton `rms_norm`, `swiglu` and (MoE) `moe.experts`.

Columns: tokens/s and MFU (median over the steps after the first five), peak device memory, and
the loss at the last step, which every row must agree on (they start from the same weights).

    bash benchmarks/gpu_train.sh                        # one H100/H200, under 8 minutes; $OUT/gpu_train.md
    .venv/bin/python benchmarks/gpu_train.py --smoke    # tiny, CPU, fp32, end to end (make test runs it)

With --smoke the models are tiny, the run is fp32 on CPU, the Triton kernels run in the
interpreter and flex attention (CUDA only) is replaced by SDPA in its row; the losses must then
agree to 1e-4 (relative).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MOE_CONFIG = {  # a small Qwen3-MoE: 64 experts, top-8
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 384, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}
SMOKE_MOE = {**MOE_CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def rows(smoke: bool, moe: bool) -> dict[str, dict[str, object]]:
    triton = {"kernels.rms_norm": "triton", "kernels.swiglu": "triton"}
    if moe:
        triton['kernels."moe.experts"'] = "triton"
    attention = "sdpa" if smoke else "flex"  # flex has no CPU backward
    return {"hf": {"model.spec": "hf"}, "native": {}, "native + compile": {"parallelism.compile": "true"},
            f"native + {attention} + Triton": {"kernels.attention": attention, **triton}}


def model_args(root: Path, smoke: bool, moe: bool) -> dict[str, object]:
    if not moe:
        return {"model.flavor": "debug" if smoke else "1.7B"}
    folder = root / "moe"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SMOKE_MOE if smoke else MOE_CONFIG))
    return {"model.hf_path": str(folder), "model.init": "random", "data.tokenizer": "qwen3"}


def run_row(root: Path, name: str, overrides: dict[str, object], args: argparse.Namespace) -> dict:
    out = root / name.replace(" ", "_").replace("+", "plus")
    common = {
        "job.output_dir": out, "job.seed": 0, "job.device": "cpu" if args.smoke else "cuda",
        "data.path": "<stdlib>", "data.tokenizer": "qwen3", "data.on_decode_error": "skip",
        "data.max_files": 40 if args.smoke else 200, "data.seq_len": args.seq_len,
        "training.steps": args.steps, "training.batch_size": args.batch_size, "training.lr": 3e-4,
        "training.warmup_steps": min(5, args.steps), "training.mixed_precision": "none" if args.smoke else "bf16",
        "checkpoint.interval": 0, "checkpoint.export_hf": "false", "checkpoint.resume": "false",
        "metrics.log_interval": 1, "metrics.progress_bar": "off",
    }
    argv = [f"--{k}={v}" for k, v in {**common, **overrides}.items()]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "titanite.cli", "train", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=args.row_timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"name": name, "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}",
                "wall_s": wall}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    steady = metrics[5:] if len(metrics) > 6 else metrics[1:] or metrics
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {"name": name, "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steady),
            "mfu": statistics.median(mfus) if mfus else None, "peak_mem_gib": max(r["mem_gib"] for r in metrics),
            "last_loss": metrics[-1]["loss"], "steps": len(metrics), "wall_s": wall}


def table(model: str, results: list[dict], tolerance: float) -> tuple[str, bool]:
    ok = [r for r in results if "error" not in r]
    losses = [r["last_loss"] for r in ok]
    spread = (max(losses) - min(losses)) / abs(min(losses)) if losses else float("nan")
    agree = bool(losses) and len(ok) == len(results) and spread <= tolerance
    base = next((r["tokens_per_sec"] for r in ok if r["name"] == "hf"), None)
    lines = [f"### {model}", "", "| row | tokens/s | vs hf | MFU | peak memory (GiB) | loss at last step | wall s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | {r['wall_s']:.0f} |")
            continue
        ratio = f"{r['tokens_per_sec'] / base:.2f}x" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        lines.append(f"| {r['name']} | {r['tokens_per_sec']:,.0f} | {ratio} | {mfu} | {r['peak_mem_gib']:.1f} | "
                     f"{r['last_loss']:.4f} | {r['wall_s']:.0f} |")
    lines += ["", f"losses agree: {'yes' if agree else 'NO'} (relative spread {spread:.2e}, tolerance {tolerance:g})", ""]
    return "\n".join(lines), agree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny models, CPU, fp32: the script end to end")
    p.add_argument("--models", nargs="+", default=["dense", "moe"], choices=("dense", "moe"))
    p.add_argument("--steps", type=int, default=0, help="default 30 (3 with --smoke)")
    p.add_argument("--seq-len", type=int, default=0, help="default 4096 (64 with --smoke)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--row-timeout", type=int, default=300)
    p.add_argument("--out", default=os.environ.get("OUT", "outputs/gpu_train"))
    args = p.parse_args(argv)
    args.steps = args.steps or (3 if args.smoke else 30)
    args.seq_len = args.seq_len or (64 if args.smoke else 4096)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tolerance = 1e-4 if args.smoke else 2e-2  # bf16 rows round differently
    report, all_agree = [], True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for model in args.models:
            results = []
            for name, overrides in rows(args.smoke, model == "moe").items():
                results.append(run_row(root, f"{model}-{name}", {**model_args(root, args.smoke, model == "moe"),
                                                                 **overrides}, args))
                results[-1]["name"] = name
                print(json.dumps(results[-1]), flush=True)
            text, agree = table(model, results, tolerance)
            all_agree &= agree
            report.append(text)
            (out / f"gpu_train_{model}.json").write_text(json.dumps(results, indent=1))
    header = (f"{'smoke run (CPU, fp32, tiny models)' if args.smoke else 'GPU run (bf16)'}: {args.steps} steps, "
              f"batch {args.batch_size} x {args.seq_len}\n\n")
    (out / "gpu_train.md").write_text(header + "\n".join(report))
    print(header + "\n".join(report))
    return 0 if all_agree else 1


if __name__ == "__main__":
    sys.exit(main())

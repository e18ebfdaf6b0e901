"""What LoRA saves: a LoRA fine-tune against a full fine-tune of the same model on the same batch.

1. Measured (CPU, fp32): a small Qwen3 saved with transformers into a temporary folder (hidden
   512, 8 layers, MLP 1536, 8 query / 4 key-value heads of 64, the tests' tiny byte-level BPE
   tokenizer and a 384-row untied vocabulary: the linear layers are nearly all of the model),
   trained with titanite's native model on 4 x 256 tokens per step, once as a full fine-tune and
   once with LoRA (rank 16, alpha 32, `target_modules = ["all-linear"]`). Every run is its own
   process, in the order full, lora, full, lora, ... (one pair per --repeats), so each has its own
   peak RSS (VmHWM) and machine noise shows as the spread between repeats. A baseline process
   that imports what a run imports (titanite.core.config, titanite.run.trainer: torch, transformers) and
   stops is measured the same way in every repeat and subtracted. A step's time is the median
   over the steps after --warmup untimed ones, as wall time and as the process's CPU time (the
   steadier figure on a shared machine; one thread by default). After the timed steps one more
   step runs under torch's profiler for the peak of live tensors, which leaves out what the heap
   keeps of freed memory (titanite keeps freed host memory on CPU, titanite.device). Both runs
   start from the same weights and batches, and LoRA's B starts at zero, so their first losses
   must agree (printed).
2. Estimated: `titanite estimate`'s memory per rank (titanite.plan.estimate, in-process) for
   Qwen3-4B and Qwen3-30B-A3B (titanite's named flavors, written as config.json into a temporary
   folder: the estimate reads no weights), full fine-tune against LoRA with the frozen base in
   fp32 and in bf16, on 1 and 8 ranks (FSDP), at batch 1 x 2048 tokens, mixed_precision bf16,
   activation_checkpoint "full", the loss that `loss = "auto"` picks on an 80 GB GPU there
   ("reference").

    .venv/bin/python benchmarks/lora.py             # the docs/performance.md tables (~3 min on 2 cores)
    .venv/bin/python benchmarks/lora.py --quick     # a smaller model, one pair, few steps (~1 min)
    .venv/bin/python benchmarks/lora.py --only estimate
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import apply_quick, machine, time_steps

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
RUNS = ("full", "lora")


def vm_hwm_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def vm_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# -- the measured runs --------------------------------------------------------------------------


def make_inputs(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """(base checkpoint folder, data file): a transformers Qwen3 with the tests' tiny tokenizer."""
    sys.path.insert(0, str(REPO))
    from tests.conftest import TINY_VOCAB, corpus_texts, make_hf_checkpoint, make_tiny_tokenizer

    tok = make_tiny_tokenizer(root / "tokenizer")
    base = make_hf_checkpoint(
        root / "base", tok, seed=0, vocab_size=TINY_VOCAB, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=4096,
        tie_word_embeddings=False)
    data = root / "data.jsonl"
    # enough text that the timed steps never see a window twice
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts(4000)))
    return base, data


def child(args: argparse.Namespace) -> None:
    """One run in this process; prints one JSON line."""
    import torch

    from titanite.core.config import load_config
    from titanite.run.trainer import Trainer

    torch.set_num_threads(args.threads)
    if args.child == "baseline":
        print(json.dumps({"peak": vm_hwm_bytes()}))
        return
    from titanite.models.lora import counts

    logging.getLogger("titanite").setLevel(logging.WARNING)
    overrides = {
        "job.output_dir": args.out, "job.device": "cpu", "model.spec": args.spec, "model.hf_path": args.base,
        "data.path": args.data, "data.seq_len": args.seq_len, "training.batch_size": args.batch_size,
        "training.steps": args.warmup + args.steps, "training.lr": 1e-4, "training.mixed_precision": "none",
        "metrics.peak_tflops": 1.0, "metrics.progress_bar": "off", "checkpoint.export_hf": "false",
    }
    if args.child == "lora":
        overrides.update({"lora.enabled": "true", "lora.rank": args.rank, "lora.alpha": args.alpha})
    trainer = Trainer(load_config(None, [f"--{k}={v}" for k, v in overrides.items()]))
    trainable, total = counts(trainer.model)
    built = vm_rss_bytes()
    losses, wall, cpu = time_steps(trainer, args.warmup + args.steps, args.warmup)
    peak = vm_hwm_bytes()  # before the profiled step, whose trace takes memory of its own
    tensor_peak = profiled_step_peak(trainer, Path(args.out) / "memory-trace.json")
    trainer.close()
    print(json.dumps({"peak": peak, "built": built, "tensor_peak": tensor_peak, "trainable": trainable,
                      "total": total, "losses": losses, "wall": wall, "cpu": cpu}))


def profiled_step_peak(trainer, trace: Path) -> int:
    """Peak bytes of live tensors over one more step: what stays allocated between steps (the
    weights, adapters, optimizer state: counted from the tensors), plus the highest total the
    profiler's allocation events reach during the step. Unlike the peak RSS this leaves out what
    glibc keeps of freed memory and its fragmentation, so it is what a caching GPU allocator
    would need."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    storages: dict[int, int] = {}
    tensors = list(trainer.model.parameters())
    tensors += [p.grad for p in trainer.model.parameters() if p.grad is not None]
    tensors += [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step().read()
        trainer.step += 1
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    during = max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=0)
    return sum(storages.values()) + during


def run_child(kind: str, args: argparse.Namespace, root: Path, base: Path, data: Path, n: int) -> dict:
    argv = [sys.executable, __file__, "--child", kind, "--base", str(base), "--data", str(data),
            "--out", str(root / f"run-{kind}-{n}"), "--threads", str(args.threads), "--spec", args.spec,
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--rank", str(args.rank), "--alpha", str(args.alpha)]
    # the token store (and anything else cached) stays in the temporary folder; the same thread
    # count for OpenMP as for torch's intra-op pool
    env = {**os.environ, "XDG_CACHE_HOME": str(root / "cache"), "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"the {kind} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="titanite-lora-bench-") as tmp:
        root = Path(tmp)
        base, data = make_inputs(root, args)
        results: list[tuple[int, str, dict]] = []
        baselines = []
        for rep in range(args.repeats):
            baselines.append(run_child("baseline", args, root, base, data, rep)["peak"])
            for kind in RUNS:
                start = time.perf_counter()
                r = run_child(kind, args, root, base, data, rep)
                r["baseline"] = baselines[-1]
                r["process_s"] = time.perf_counter() - start
                results.append((rep + 1, kind, r))
                print(f"  repeat {rep + 1} {kind}: {r['process_s']:.0f} s", file=sys.stderr, flush=True)
    tokens = args.batch_size * args.seq_len
    first = {kind: r["losses"][0] for _, kind, r in results}
    print(f"\nmodel: hidden {args.hidden}, {args.layers} layers, MLP {args.intermediate}, {args.heads} query / "
          f"{args.kv_heads} key-value heads of {args.head_dim}, {results[0][2]['total']:,} parameters; "
          f"{args.batch_size} x {args.seq_len} tokens per step, fp32, {args.spec} backend, {args.threads} thread(s); "
          f"LoRA rank {args.rank}, alpha {args.alpha:g}, all-linear; median of {args.steps} steps after "
          f"{args.warmup} untimed; baseline peak RSS (imports only) "
          f"{', '.join(f'{b / GIB:.2f}' for b in baselines)} GiB")
    print("first losses: " + ", ".join(f"{kind} {r['losses'][0]:.6f}" for _, kind, r in results))
    if len({round(v, 5) for v in first.values()}) != 1:
        print("WARNING: the first losses differ: the runs did not start from the same model and batch")
    print("\n| repeat | run | trainable params | peak RSS above baseline (GiB) | RSS after set-up above baseline (GiB) "
          "| peak of live tensors (GiB) | wall s/step | CPU s/step | tokens/s (wall) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rep, kind, r in results:
        w, c = statistics.median(r["wall"]), statistics.median(r["cpu"])
        print(f"| {rep} | {kind} | {r['trainable']:,} | {(r['peak'] - r['baseline']) / GIB:.3f} | "
              f"{(r['built'] - r['baseline']) / GIB:.3f} | {r['tensor_peak'] / GIB:.3f} | {w:.2f} | {c:.2f} | "
              f"{tokens / w:,.0f} |")
    print("\n| repeat | LoRA / full: trainable params | peak RSS above baseline | peak of live tensors | wall s/step "
          "| CPU s/step |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    by = {(rep, kind): r for rep, kind, r in results}
    for rep in range(1, args.repeats + 1):
        f, lo = by[rep, "full"], by[rep, "lora"]
        print(f"| {rep} | {lo['trainable'] / f['trainable']:.4f} | "
              f"{(lo['peak'] - lo['baseline']) / (f['peak'] - f['baseline']):.2f}x | "
              f"{lo['tensor_peak'] / f['tensor_peak']:.2f}x | "
              f"{statistics.median(lo['wall']) / statistics.median(f['wall']):.2f}x | "
              f"{statistics.median(lo['cpu']) / statistics.median(f['cpu']):.2f}x |")
    sys.stdout.flush()


# -- the estimates ------------------------------------------------------------------------------


def estimate_rows(args: argparse.Namespace) -> None:
    from titanite.core.config import load_config
    from titanite.models.qwen3.args import to_hf_config
    from titanite.models.qwen3.flavors import get_flavor
    from titanite.plan import estimate

    logging.getLogger("titanite").setLevel(logging.WARNING)
    common = {"data.seq_len": 2048, "training.batch_size": 1, "training.mixed_precision": "bf16",
              "parallelism.activation_checkpoint": "full", "kernels.loss": "reference",
              "lora.rank": args.rank, "lora.alpha": args.alpha}
    runs = {"full fine-tune": {"lora.enabled": "false"},
            "LoRA, base fp32": {"lora.enabled": "true", "lora.base_dtype": "fp32"},
            "LoRA, base bf16": {"lora.enabled": "true", "lora.base_dtype": "bf16"}}
    print(f"\nestimate (titanite.plan.estimate): batch 1 x 2048, mixed_precision bf16, activation_checkpoint full, "
          f"loss reference; LoRA rank {args.rank}, alpha {args.alpha:g}, all-linear; GiB per rank")
    print("\n| model | run | ranks | trainable params | parameters | gradients | optimizer | activations + "
          "recomputed block | transient | peak per rank | vs full |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    same_as_full = False
    with tempfile.TemporaryDirectory(prefix="titanite-lora-estimate-") as tmp:
        for flavor in args.flavors:
            folder = Path(tmp) / flavor
            folder.mkdir()
            flavor_args = get_flavor(flavor)
            (folder / "config.json").write_text(json.dumps(to_hf_config(flavor_args)))
            for ranks in (1, 8):
                est = {name: estimate(load_config(None, [f"--{k}={v}" for k, v in
                                                         {"model.hf_path": folder, **common, **extra}.items()]), ranks,
                                        on_gloo=False)
                       for name, extra in runs.items()}
                full = est["full fine-tune"]
                every = next(e.lora.base for e in est.values() if e.lora is not None)  # the model's parameters
                for name, e in est.items():
                    same_as_full |= e is not full and abs(e.total - full.total) < 1
                    trainable = e.lora.adapters if e.lora is not None else every
                    print(f"| Qwen3-{flavor} | {name} | {ranks} | {trainable / 1e6:,.1f}M | {e.params / GIB:.2f} | "
                          f"{e.grads / GIB:.2f} | {e.optimizer / GIB:.2f} | "
                          f"{(e.activations + e.recompute) / GIB:.2f} | "
                          f"{e.transient / GIB:.2f} | {e.total / GIB:.2f} | {e.total / full.total:.2f}x |")
    if same_as_full:
        print("WARNING: a LoRA estimate equals the full fine-tune's: this titanite/plan does not count LoRA")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("measure", "estimate"), help="one of the two parts (default both)")
    p.add_argument("--quick", action="store_true", help="hidden 256, 4 layers, MLP 768, one pair of runs, "
                                                        "1 + 3 steps")
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs (full, lora) in turn")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run (the median is reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads per run (default 1: on a shared machine idle OpenMP threads spin and "
                        "inflate CPU time; one thread's CPU time is the steady measure, as in backends.py)")
    p.add_argument("--spec", default="qwen3", choices=("qwen3", "hf"), help="model.spec of the measured runs")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--flavors", nargs="+", default=["4B", "30B-A3B"], help="flavors for the estimate rows")
    p.add_argument("--child", choices=("baseline",) + RUNS, help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        apply_quick(args, steps=3)
    print(machine())
    sys.stdout.flush()
    if args.only != "estimate":
        measure(args)
    if args.only != "measure":
        estimate_rows(args)


if __name__ == "__main__":
    main()

"""Long context on CPU: tokens/s and peak memory per rank under context parallelism
(`parallelism.cp` = 1, 2, 4) for sequences of 2k to 32k tokens, the planner's estimate beside each,
and the share of a layer's attention time that the all-gather of the keys and values takes.

The model: a native Qwen3 (`model.spec = "qwen3"`, `model.init = "random"`, fp32) from a
config.json written with transformers' Qwen3Config: hidden 256, 4 layers, MLP 768, 8 query / 2
key-value heads of 32, the tests' tiny byte-level BPE (384-row untied vocabulary), so attention,
not the head, is the long sequences' work. The data: a synthetic text corpus (JSON lines), packed
as one stream (`data.packing = "stream"`), tokenized once into a token store every run reads.

Each (seq_len, cp) pair is one `torch.distributed.run --standalone --nproc_per_node=cp` job of
titanite.train (under a small rank wrapper, benchmarks/long_context_child.py), batch 1 x seq_len,
--steps steps (default 3), OMP_NUM_THREADS = max(1, cores / cp): on this 2-core machine cp = 4
runs 4 ranks on 2 cores (oversubscribed: its throughput is not a per-core figure; its memory is).
Measured per run:

- tokens/s: metrics.jsonl's `tokens_per_sec` (rank 0 writes it; the whole sequence's tokens over
  the step's wall time), the median over the steps after the first;
- peak RSS per rank: each rank's VmHWM (/proc/self/status, the kernel's high-water mark) when the
  end-of-run save begins, i.e. through the training steps; the largest over the ranks, and the
  same above a process that only imports titanite.run.trainer (the floor);
- estimate: titanite.plan.estimate(config, world = cp).total, the planner's per-rank peak of the
  training step (what `titanite estimate --config X --world-size cp` prints), which counts tensors,
  not the process.

The gather share (--gather-share, on by default; --no-train runs it alone): on 2 gloo ranks, one
attention layer of the model at S = 8192 and 32768 (B 1, 8 / 2 heads of 32, fp32, one thread a
rank), forward + backward of (a) the K and V all-gather (gather_sequence: two all-gathers, two
reduce-scatters in backward), (b) the attention of the rank's two query chunks over their key
prefixes on keys already gathered, and (c) both, as the trainer runs them
(context_parallel.wrap(sdpa) under context_parallel.active(Layout)). Median of 3 after one
untimed call of each, the three alternating (a neighbour's load on a shared machine falls on all
three alike), the slowest rank's time.

    .venv/bin/python benchmarks/long_context.py            # the docs/performance.md tables
    .venv/bin/python benchmarks/long_context.py --quick    # 2k and 8k, cp 1 and 2, gather at 8k (< 2 min)
    .venv/bin/python benchmarks/long_context.py --seq-lens 8192 --cps 2 4 --no-gather-share
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import TINY_VOCAB_HELP, add_model_args, child_baseline, launch, print_header, run_env, tiny_inputs

REPO = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).resolve().parent / "long_context_child.py"
GIB = 2**30
RECORD_ENV = "TITANITE_LC_RECORD"


# -- inputs -------------------------------------------------------------------------------------


def make_inputs(root: Path, args: argparse.Namespace, env: dict[str, str]) -> tuple[Path, Path, int]:
    """The model folder, the corpus (about twice the tokens a run reads), the parameter count."""
    return tiny_inputs(root, args, env, max(args.seq_lens), 2 * (args.steps + 1) * max(args.seq_lens), "the model reads tokens and predicts the next token while the optimizer lowers the loss on every step of training data in small batches and long sequences are split over the ranks")


def overrides(folder: Path, data: Path, out: Path, seq_len: int, cp: int, args: argparse.Namespace) -> list[str]:
    return [f"--{k}={v}" for k, v in {
        "job.output_dir": out, "job.device": "cpu", "model.spec": "qwen3", "model.hf_path": folder,
        "model.init": "random", "data.path": data, "data.packing": "stream", "data.seq_len": seq_len,
        "training.batch_size": 1, "training.steps": args.steps, "training.mixed_precision": "none",
        "checkpoint.export_hf": "false", "checkpoint.interval": 0, "metrics.log_interval": 1,
        "metrics.peak_tflops": 1, "metrics.progress_bar": "off", "parallelism.cp": cp}.items()]


# -- the runs -----------------------------------------------------------------------------------


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def baseline(root: Path, env: dict[str, str]) -> dict[str, int]:
    return child_baseline(root, env, CHILD, RECORD_ENV)


def sweep(args: argparse.Namespace, root: Path, folder: Path, data: Path, env: dict[str, str],
          base: dict[str, int]) -> list[dict]:
    from titanite.core.config import load_config
    from titanite.plan import estimate

    cores = os.cpu_count() or 1
    skip = {tuple(int(x) for x in s.split(":")) for s in args.skip}
    results = []
    for seq_len in args.seq_lens:
        for cp in args.cps:
            r: dict = {"seq_len": seq_len, "cp": cp, "threads": max(1, cores // cp)}
            results.append(r)
            if (seq_len, cp) in skip:
                r["error"] = "skipped (--skip)"
                continue
            out = root / f"run-{seq_len}-{cp}"
            train_argv = overrides(folder, data, out, seq_len, cp, args)
            try:
                est = estimate(load_config(None, train_argv), cp)
                r["estimate"] = est.total
                r["estimate_phase"] = max(est.phases, key=est.phases.get)
                r["estimate_knows_cp"] = est.context is not None if cp > 1 else "-"
            except Exception as e:  # the planner is work in progress: record what it says
                r["estimate_error"] = f"{type(e).__name__}: {e}"
            need = cp * (1.3 * r.get("estimate", 0) + base["VmHWM"])
            if need > mem_available():
                r["error"] = f"skipped: would need ~{need / GIB:.1f} GiB, {mem_available() / GIB:.1f} GiB available"
                continue
            run_env = {**env, "OMP_NUM_THREADS": str(r["threads"])}
            r["load"] = Path("/proc/loadavg").read_text().split()[0]  # a shared machine: what else ran
            r.update(launch(cp, CHILD, RECORD_ENV, train_argv, root / f"record-{seq_len}-{cp}", run_env, args.timeout))
            shutil.rmtree(out, ignore_errors=True)
            if "error" in r:
                print(f"  seq_len {seq_len} cp {cp}: FAILED ({r['error']})\n{r['tail']}", file=sys.stderr, flush=True)
                continue
            steady = [x for x in r["rows"] if x["step"] > 1] or r["rows"]
            r["tps"] = statistics.median(x["tokens_per_sec"] for x in steady)
            r["loss1"] = r["rows"][0]["loss"]
            r["tokens"] = r["rows"][0]["tokens_seen"]
            peaks = [x.get("before_save", x["exit"])["VmHWM"] for x in r["ranks"]]
            r["peak"], r["peak_min"] = max(peaks), min(peaks)
            r["rank0_metrics_rss"] = r["rows"][-1]["host_peak_rss_gib"]
            r["rank_threads"] = [x["threads"] for x in r["ranks"]]
            print(f"  seq_len {seq_len} cp {cp}: {r['tps']:,.0f} tokens/s, peak RSS {r['peak'] / GIB:.2f} GiB/rank, "
                  f"estimate {r.get('estimate', float('nan')) / GIB:.2f} GiB, job {r['wall']:.0f} s",
                  file=sys.stderr, flush=True)
    return results


def gather_share(args: argparse.Namespace, env: dict[str, str]) -> list[dict]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(CHILD),
            "--gather-share", "--seq-lens", *map(str, args.gather_seq_lens), "--heads", str(args.heads),
            "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim)]
    proc = subprocess.run(argv, env={**env, "OMP_NUM_THREADS": "1"}, cwd=REPO, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        print(f"the gather-share run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", flush=True)
        return []
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


# -- the report ---------------------------------------------------------------------------------


def report(args: argparse.Namespace, results: list[dict], base: dict[str, int], params: int) -> None:
    print(f"\nmodel: native qwen3, hidden {args.hidden}, {args.layers} layers, MLP {args.intermediate}, {args.heads} "
          f"query / {args.kv_heads} key-value heads of {args.head_dim}, vocabulary {args.vocab} (untied), "
          f"{params:,} parameters, fp32, random init; batch 1 x seq_len, {args.steps} steps (tokens/s: median of "
          f"steps 2..{args.steps}); OMP_NUM_THREADS = max(1, {os.cpu_count()} cores / cp)")
    print(f"floor (a process that only imports titanite.run.trainer): VmHWM {base['VmHWM'] / GIB:.2f} GiB")
    print("\n| seq_len | cp | ranks x threads | tokens/s | s/step | peak RSS per rank GiB | above imports GiB "
          "| estimate per rank GiB | estimate / above imports |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        est = f"{r['estimate'] / GIB:.3f}" if "estimate" in r else "error"
        head = f"| {r['seq_len']:,} | {r['cp']} | {r['cp']} x {r['threads']} |"
        if "tps" not in r:
            print(f"{head} {r['error']} | | | | {est} | |")
            continue
        above = r["peak"] - base["VmHWM"]
        ratio = f"{r['estimate'] / above:.2f}" if "estimate" in r else "-"
        print(f"{head} {r['tps']:,.0f} | {r['seq_len'] / r['tps']:.2f} | {r['peak'] / GIB:.2f} | {above / GIB:.2f} | "
              f"{est} | {ratio} |")
    print("\nper run: ranks' peak RSS (min-max GiB), rank 0's metrics.jsonl host_peak_rss_gib, first loss, tokens a "
          "step, threads per rank, the estimate's peak phase, launch to exit, load average before:")
    for r in results:
        if "tps" in r:
            print(f"  {r['seq_len']} cp {r['cp']}: {r['peak_min'] / GIB:.2f}-{r['peak'] / GIB:.2f}, "
                  f"{r['rank0_metrics_rss']:.2f}, loss {r['loss1']:.6f}, {r['tokens']} tokens, threads "
                  f"{r['rank_threads']}, {r.get('estimate_phase', '-')} (context counted: "
                  f"{r.get('estimate_knows_cp', '-')}), {r['wall']:.0f} s, load {r['load']}")
        if "estimate_error" in r:
            print(f"  {r['seq_len']} cp {r['cp']}: the estimate failed: {r['estimate_error']}")
    for r in results:
        if "tail" in r:
            print(f"\n{r['seq_len']} cp {r['cp']} failed ({r['error']}); the last lines:\n{r['tail'][-1500:]}")


def report_gather(rows: list[dict]) -> None:
    if not rows:
        return
    print("\ngather share: one attention layer, 2 gloo ranks x 1 thread, forward + backward, median of 3 "
          "alternating calls (s):")
    print("\n| S | K+V gathered MiB | all-gather (fwd + bwd) s | attention of the local chunks s | the layer as "
          "trained (gather + attention) s | gather / layer |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for g in rows:
        print(f"| {g['seq_len']:,} | {g['gathered_bytes'] / 2**20:.0f} | {g['gather_s']:.3f} | {g['compute_s']:.2f} | "
              f"{g['layer_s']:.2f} | {g['gather_s'] / g['layer_s']:.1%} |")
    print("every repeat (s): " + "; ".join(f"{g['seq_len']} " + ", ".join(
        f"{k} " + "/".join(f"{x:.3f}" for x in v) for k, v in g["all"].items()) for g in rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2048 and 8192 tokens, cp 1 and 2, the gather at 8192")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--skip", nargs="*", default=[], metavar="SEQ:CP", help="pairs not to run, e.g. 32768:4")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (the first is not reported)")
    p.add_argument("--gather-seq-lens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--no-gather-share", dest="gather", action="store_false", help="the training sweep only")
    p.add_argument("--no-train", dest="train", action="store_false", help="the gather share only")
    p.add_argument("--timeout", type=float, default=900, help="seconds per torchrun job")
    add_model_args(p, vocab=384, hidden=256, intermediate=768, layers=4, heads=8, kv_heads=2, head_dim=32,
                   vocab_help=TINY_VOCAB_HELP)
    args = p.parse_args()
    if args.quick:
        args.seq_lens, args.cps, args.gather_seq_lens = [2048, 8192], [1, 2], [8192]
    print_header()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="titanite-long-context-bench-") as tmp:
        root = Path(tmp)
        env = run_env(root)
        if args.train:
            folder, data, params = make_inputs(root, args, env)
            print(f"inputs written in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
            base = baseline(root, env)
            results = sweep(args, root, folder, data, env, base)
        gathered = gather_share(args, env) if args.gather else []
    if args.train:
        report(args, results, base, params)
    report_gather(gathered)
    print(f"\nwhole benchmark: {time.perf_counter() - began:.0f} s (load average at the end: "
          f"{Path('/proc/loadavg').read_text().split()[0]})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

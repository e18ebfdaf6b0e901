"""Pipeline parallelism on CPU: tokens/s and peak memory per rank of pp = 2 and 4 against FSDP
alone, on 4 ranks, with each schedule's measured bubble beside the planner's.

The model: a native Qwen3 (`model.spec = "qwen3"`, `model.init = "random"`, fp32) from a
config.json written with transformers' Qwen3Config: hidden 256, 8 layers, MLP 768, 4 query / 2
key-value heads of 64, the tests' tiny byte-level BPE (384-row vocabulary), untied embeddings
(pipeline parallelism needs them). The data: a synthetic text corpus (JSON lines), packed as
one stream (`data.packing = "stream"`), tokenized once into a token store every run reads.

Every layout is one `torch.distributed.run --standalone --nproc_per_node=4` job of
titanite.train (under a small rank wrapper, benchmarks/pipeline_child.py), the same step in
all: seq_len 256, batch_size 1, global_batch_size 16 (16 sequences, 4,096 tokens a step), so

- FSDP alone: dp_shard 4, 4 micro-batches per rank (gradient accumulation);
- pp = 2: 2 pipeline stages (ranks) x dp_shard 2, 8 micro-batches per pipeline pass;
- pp = 4: 4 stages x dp_shard 1, 16 micro-batches per pass;

each schedule of --schedules (default: every one titanite.parallel.pipeline_layout.SCHEDULES
lists; 1F1B and GPipe run a stage per rank, the others 2, so 2 pp stages of 8 / (2 pp) layers)
at `pp_microbatches = 0` (the whole step in one pass; the zero-bubble schedules only at pp = 4,
as titanite refuses them with FSDP),
the stages split by the planner's balanced split (`pp_split` empty). OMP_NUM_THREADS = 1 on
every rank: 4 ranks on this machine's cores. On a 2-core machine the 4 ranks are
oversubscribed (2 ranks a core): the throughput is not a per-core figure, and a rank that
waits in the pipeline's bubble gives its core to another rank, so the bubble costs this
machine less than it costs one with a core (or an accelerator) per rank. The memory is exact.

Measured per run:

- tokens/s: metrics.jsonl's `tokens_per_sec` (rank 0 writes it: the step's 4,096 tokens over
  the step's wall time), the median over the steps after the first (warm-up: the schedule's
  shape inference, the allocator's first growth);
- peak RSS per rank: each rank's VmHWM (/proc/self/status, the kernel's high-water mark)
  when the end-of-run save begins, i.e. through the training steps; every rank's, and the
  largest. The floor: a process that only imports titanite.run.trainer. All 4 ranks share the
  machine's memory: the job's total is about the sum;
- measured bubble: per rank and pipeline pass, 1 - compute / pass, where `pass` is the wall
  time of `Pipeline.step` (the schedule's forwards and backwards of the pass's micro-batches,
  with its p2p sends and receives) and `compute` is the wall time spent inside the stage's
  compute actions of that pass: torch.distributed.pipelining's `forward_one_chunk`,
  `backward_one_chunk` and `backward_weight_one_chunk` (the only calls that run the stage's
  module or its autograd graph; each schedule waits for the neighbour's activations or
  gradients before calling them, so waiting is never inside one; FSDP's all-gathers and
  reduce-scatters of the stage's data-parallel ranks are, and count as compute). So the
  measured bubble is the share of the pass a rank spends not computing: waiting for the
  other stages (the schedule's bubble), the p2p transfers and the schedule's bookkeeping. The
  median over the passes after the first, per rank; the table shows the mean over the 4 ranks
  and each rank's. The planner's bubble is `PipelineLayout.bubble()` of the layout the trainer
  resolved (`Schedule.bubble(pp, micro-batches)`: (pp - 1) / v idle stage-slots over the
  micro-batches, forward 1 and backward 2 units, v stages per rank), what the trainer logs.
  Two caveats: on an oversubscribed machine a compute action's wall time includes the time
  its rank waited for a core, which inflates `compute` (so the measured bubble reads low);
  the details give each rank's on-core share of its compute (thread CPU time / wall time
  inside the actions, 1.0 on an idle core) to size that. And the planner assumes equal
  stages, while the first stage adds the embedding and the last the norm, head and loss.
- tokens / CPU-s: the step's tokens over the CPU seconds the 4 ranks spent in it together
  (process_time of `Trainer.train_step` on every rank, summed; the median over the steps after
  the first): what a step costs the machine, which neither the oversubscription nor another
  job's load on the cores changes much (a rank waiting in the bubble or on a transfer sleeps,
  it does not spin: see the details' pass CPU / wall). On an idle 2-core machine tokens/s is
  at most 2 x this;
- others: the CPU the rest of the machine used during the job, in cores on average (/proc/stat's
  busy time less this benchmark's children's rusage); a row above 0.2 is marked (*): this
  benchmark shares its machine with whatever else runs there;
- the losses: every layout trains the same weights on the same batches, so its losses must
  be FSDP's up to summation order; a layout whose losses differ by more than 2e-3 gets a
  WARNING under the table (its step is not the same step, so its speed is not comparable);
- pass / step: the share of the step's wall time (4,096 / tokens/s) the pipeline pass takes
  (the rest: the data, the gradient clipping over the stages, the optimizer).

    .venv/bin/python benchmarks/pipeline.py            # every layout and schedule (~6 min on 2 cores)
    .venv/bin/python benchmarks/pipeline.py --quick    # FSDP and pp = 2 1F1B, 2 steps (< 1 min)
    .venv/bin/python benchmarks/pipeline.py --pps 2 --schedules 1F1B ZBVZeroBubble --steps 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, TINY_VOCAB_HELP, add_model_args, child_baseline, launch, print_header, run_env, tiny_inputs

CHILD = Path(__file__).resolve().parent / "pipeline_child.py"
GIB = 2**30
RECORD_ENV = "TITANITE_PP_RECORD"
RANKS = 4
LOSS_TOL = 2e-3  # the most two layouts' losses may differ by (summation order) before a warning
OTHERS = 0.2  # cores of other processes' CPU during a job above which its row is marked


# -- inputs -------------------------------------------------------------------------------------


def make_inputs(root: Path, args: argparse.Namespace, env: dict[str, str]) -> tuple[Path, Path, int]:
    """The model folder, the corpus (about twice the tokens a run reads), the parameter count."""
    return tiny_inputs(root, args, env, args.seq_len, 2 * (args.steps + 1) * args.global_batch * args.seq_len, "the model reads tokens and predicts the next token while the optimizer lowers the loss on every step of training data in small batches")


def overrides(folder: Path, data: Path, out: Path, run: dict, args: argparse.Namespace) -> list[str]:
    keys = {
        "job.output_dir": out, "job.device": "cpu", "model.spec": "qwen3", "model.hf_path": folder,
        "model.init": "random", "data.path": data, "data.packing": "stream", "data.seq_len": args.seq_len,
        "training.batch_size": args.batch_size, "training.global_batch_size": args.global_batch,
        "training.steps": args.steps, "training.mixed_precision": "none", "checkpoint.export_hf": "false",
        "checkpoint.interval": 0, "metrics.log_interval": 1, "metrics.peak_tflops": 1,
        "metrics.progress_bar": "off", "parallelism.pp": run["pp"], "parallelism.dp_shard": RANKS // run["pp"]}
    if run["pp"] > 1:
        keys |= {"parallelism.pp_schedule": run["schedule"], "parallelism.pp_microbatches": 0}
    return [f"--{k}={v}" for k, v in keys.items()]


# -- the runs -----------------------------------------------------------------------------------


def baseline(root: Path, env: dict[str, str]) -> dict[str, int]:
    return child_baseline(root, env, CHILD, RECORD_ENV)


def summarize(r: dict, tokens_per_step: int) -> None:
    steady = [x for x in r["rows"] if x["step"] > 1] or r["rows"]
    r["tps"] = statistics.median(x["tokens_per_sec"] for x in steady)
    r["step_s"] = tokens_per_step / r["tps"]
    r["losses"] = [x["loss"] for x in r["rows"]]
    r["peaks"] = [x.get("before_save", x["exit"])["VmHWM"] for x in r["ranks"]]
    r["rank0_metrics_rss"] = r["rows"][-1].get("host_peak_rss_gib")
    r["rank_threads"] = [x["threads"] for x in r["ranks"]]
    # CPU seconds of the 4 ranks together per step (by step number: every rank runs every step)
    cpu = {}
    for x in r["ranks"]:
        for st in x["steps"]:
            cpu[st["step"]] = cpu.get(st["step"], 0.0) + st["cpu_s"]
    r["cpu_step"] = statistics.median([c for k, c in cpu.items() if k > 1] or list(cpu.values()))
    r["tpcpu"] = tokens_per_step / r["cpu_step"]
    if r["pp"] == 1:
        return
    layout = r["ranks"][0]["layout"]
    r["planner"], r["microbatches"], r["describe"] = layout["bubble"], layout["microbatches"], layout["describe"]
    r["stages"] = [x["layout"]["stages"] for x in r["ranks"]]
    r["bubbles"], r["oncore"], r["pass_s"], r["pass_cpu"] = [], [], [], []
    for x in r["ranks"]:
        passes = [p for p in x["passes"] if p["step"] > 1] or x["passes"]
        r["bubbles"].append(statistics.median(1 - p["compute_s"] / p["wall_s"] for p in passes))
        r["oncore"].append(sum(p["compute_cpu_s"] for p in passes) / sum(p["compute_s"] for p in passes))
        r["pass_s"].append(statistics.median(p["wall_s"] for p in passes))
        r["pass_cpu"].append(sum(p["cpu_s"] for p in passes) / sum(p["wall_s"] for p in passes))
    r["bubble"] = statistics.mean(r["bubbles"])


def plan_runs(args: argparse.Namespace) -> list[dict]:
    runs = [{"name": f"FSDP (dp_shard {RANKS})", "pp": 1, "schedule": "-", "microbatches": args.global_batch //
             (args.batch_size * RANKS)}]
    from titanite.parallel.pipeline_layout import SCHEDULES

    for pp in args.pps:
        for s in args.schedules:
            if RANKS // pp > 1 and SCHEDULES[s].split_backward:
                continue  # titanite refuses zero-bubble schedules with FSDP (their weight pass runs after its reduce)
            runs.append({"name": f"pp {pp} x dp_shard {RANKS // pp}", "pp": pp, "schedule": s})
    return runs


def sweep(args: argparse.Namespace, root: Path, folder: Path, data: Path, env: dict[str, str]) -> list[dict]:
    results = []
    tokens_per_step = args.global_batch * args.seq_len
    for i, run in enumerate(plan_runs(args)):
        r = dict(run)
        results.append(r)
        out = root / f"run-{i}"
        r["load"] = Path("/proc/loadavg").read_text().split()[0]  # a shared machine: what else ran
        r.update(launch(RANKS, CHILD, RECORD_ENV, overrides(folder, data, out, run, args), root / f"record-{i}", env,
                        args.timeout))
        shutil.rmtree(out, ignore_errors=True)
        if "error" in r:
            print(f"  {r['name']} {r['schedule']}: FAILED ({r['error']})", file=sys.stderr, flush=True)
            continue
        summarize(r, tokens_per_step)
        bubble = f", bubble {r['bubble']:.1%} (planner {r['planner']:.1%})" if "bubble" in r else ""
        print(f"  {r['name']} {r['schedule']}: {r['tps']:,.0f} tokens/s, peak RSS {max(r['peaks']) / GIB:.2f} "
              f"GiB/rank{bubble}, job {r['wall']:.0f} s", file=sys.stderr, flush=True)
    return results


# -- the report ---------------------------------------------------------------------------------


def report(args: argparse.Namespace, results: list[dict], base: dict[str, int], params: int) -> None:
    print(f"\nmodel: native qwen3, hidden {args.hidden}, {args.layers} layers, MLP {args.intermediate}, {args.heads} "
          f"query / {args.kv_heads} key-value heads of {args.head_dim}, vocabulary {args.vocab} (untied), "
          f"{params:,} parameters, fp32, random init; seq_len {args.seq_len}, batch_size {args.batch_size}, "
          f"global_batch_size {args.global_batch} ({args.global_batch * args.seq_len:,} tokens a step); "
          f"{RANKS} ranks x OMP_NUM_THREADS=1 on {os.cpu_count()} cores; {args.steps} steps (tokens/s and "
          f"bubbles: median of steps 2..{args.steps})")
    if (os.cpu_count() or 1) < RANKS:
        print(f"NOTE: {RANKS} ranks on {os.cpu_count()} cores: oversubscribed, so the ranks contend for CPU. A rank "
              "idle in the bubble frees its core for another rank (the bubble costs less here than with a core per "
              "rank), and compute waiting for a core counts as compute (the measured bubble reads low). Memory is "
              "exact.")
    print(f"floor (a process that only imports titanite.run.trainer): VmHWM {base['VmHWM'] / GIB:.2f} GiB")
    fsdp = next((r["tps"] for r in results if r["pp"] == 1 and "tps" in r), None)
    print("\n| layout | schedule | micro-batches | tokens/s | vs FSDP | tokens / CPU-s | peak RSS max GiB "
          "| peak RSS per rank GiB | measured bubble (mean; per rank) | planner bubble |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for r in results:
        mb = r.get("microbatches", "?")
        mb = f"{mb} per rank" if r["pp"] == 1 else f"{mb} per pass"
        busy = " (*)" if r.get("others", 0) > OTHERS else ""
        head = f"| {r['name']}{busy} | {r['schedule']} | {mb} |"
        if "tps" not in r:
            print(f"{head} {r['error']} | | | | | | |")
            continue
        ratio = f"{r['tps'] / fsdp:.2f}" if fsdp else "-"
        peaks = " / ".join(f"{p / GIB:.2f}" for p in r["peaks"])
        if r["pp"] == 1:
            bubble, planner = "- (no pipeline)", "0"
        else:
            bubble = f"{r['bubble']:.1%}; " + " / ".join(f"{b:.0%}" for b in r["bubbles"])
            planner = f"{r['planner']:.1%}"
        print(f"{head} {r['tps']:,.0f} | {ratio} | {r['tpcpu']:,.0f} | {max(r['peaks']) / GIB:.2f} | {peaks} | "
              f"{bubble} | {planner} |")
    # every layout trains the same weights on the same batches: the losses agree up to summation order
    ref = next((r["losses"] for r in results if r["pp"] == 1 and "losses" in r), None)
    for r in results:
        if ref is None or "losses" not in r or r["pp"] == 1:
            continue
        off = [i + 1 for i, (a, b) in enumerate(zip(ref, r["losses"])) if abs(a - b) > LOSS_TOL]
        if off:
            print(f"\nWARNING: {r['name']} {r['schedule']}: the loss differs from FSDP's by more than {LOSS_TOL} from "
                  f"step {off[0]} on (step {off[0]}: {r['losses'][off[0] - 1]:.4f} vs {ref[off[0] - 1]:.4f}; last: "
                  f"{r['losses'][-1]:.4f} vs {ref[-1]:.4f}): its gradients are not those of the same step")
    if any(r.get("others", 0) > OTHERS for r in results):
        print(f"\n(*) other processes used more than {OTHERS} of a core on average during that job (see 'others' "
              "below): its tokens/s is low by about their share of the cores; tokens / CPU-s and memory are not "
              "affected much.")
    print("\nper run: the resolved layout (stages per rank), pass s per rank, pass / step, on-core share of compute "
          "per rank, the main thread's CPU / wall over the pass per rank, every step's loss, rank 0's metrics "
          "host_peak_rss_gib, launch to exit, load average before, the other processes' CPU during the job (cores):")
    for r in results:
        if "tps" not in r:
            continue
        line = f"  {r['name']} {r['schedule']}: step {r['step_s']:.2f} s, {r['cpu_step']:.2f} CPU-s (4 ranks)"
        if r["pp"] > 1:
            line += (f"; {r['describe']}; stages {r['stages']}; pass s " + " / ".join(f"{s:.2f}" for s in r["pass_s"])
                     + f"; pass / step {statistics.mean(r['pass_s']) / r['step_s']:.0%}; on-core "
                     + " / ".join(f"{x:.2f}" for x in r["oncore"]) + "; pass CPU / wall "
                     + " / ".join(f"{x:.2f}" for x in r["pass_cpu"]))
        print(f"{line}; losses " + " ".join(f"{x:.4f}" for x in r["losses"]) + "; rank 0 metrics RSS "
              f"{r['rank0_metrics_rss']:.2f} GiB; threads {r['rank_threads']}; {r['wall']:.0f} s; load {r['load']}; "
              f"others {r['others']:.2f} cores")
    for r in results:
        if "tail" in r:
            print(f"\n{r['name']} {r['schedule']} failed ({r['error']}); error lines:\n  "
                  + "\n  ".join(r.get("causes", [])) + f"\nthe ranks' last lines:\n{r['tail'][-2500:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="FSDP and pp 2 with 1F1B, 2 steps")
    p.add_argument("--pps", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    p.add_argument("--schedules", nargs="+", default=None,
                   help="pipeline schedules to run (default: every one titanite.parallel.pipeline_layout lists)")
    p.add_argument("--steps", type=int, default=6, help="training steps per run (the first is not reported)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per torchrun job")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=16)
    add_model_args(p, vocab=384, hidden=256, intermediate=768, layers=8, heads=4, kv_heads=2, head_dim=64,
                   vocab_help=TINY_VOCAB_HELP)
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    if args.schedules is None:
        from titanite.parallel.pipeline_layout import SCHEDULES

        args.schedules = list(SCHEDULES)
    if args.quick:
        args.pps, args.schedules, args.steps = [2], ["1F1B"], 2
    print_header()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="titanite-pipeline-bench-") as tmp:
        root = Path(tmp)
        env = run_env(root, OMP_NUM_THREADS="1")
        folder, data, params = make_inputs(root, args, env)
        print(f"inputs written in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
        base = baseline(root, env)
        results = sweep(args, root, folder, data, env)
    report(args, results, base, params)
    print(f"\nwhole benchmark: {time.perf_counter() - began:.0f} s (load average at the end: "
          f"{Path('/proc/loadavg').read_text().split()[0]})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

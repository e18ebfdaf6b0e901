"""Start-up memory and time of a ~400M-parameter Qwen3 on 1, 2, 4 and 8 CPU ranks.

titanite builds the model on the meta device, applies the parallel plan (FSDP2 over the ranks
here) on meta, allocates each rank's shards and only then initialises or loads them, one on-disk
tensor at a time (titanite/formats/sharded.py). Target per rank: 1.1 x (16 bytes x
parameters / N + the largest tensor).

The model: a transformers Qwen3 (hidden 1024, 7 layers, MLP 3072, 16 / 8 heads of 64, untied
151,936-row vocabulary: 399.3M parameters) saved as fp32 safetensors by a separate process; the
real Qwen3 tokenizer (`data.tokenizer = "qwen3"`) and a small text file, tokenized once.

Every run is `torch.distributed.run --standalone --nproc_per_node=N` (N = 1: plain python) of
this file's rank wrapper around titanite.train's main, `--model.init=random` or `pretrained`, one
step of 1 x 64 tokens, no export, a fresh output folder, OMP_NUM_THREADS=1. Measured:

- start-up time: launch to the trainer's "model qwen3: ... parameters" line, the last thing
  Trainer start-up logs (rank 0), stamped as the launcher's stderr delivers it;
- each rank's peak RSS: the kernel's VmHWM (/proc/self/status, exact) read right after the log
  line, when the end-of-run checkpoint save begins (through the step) and at exit (the whole
  run); and RssAnon sampled every 10 ms by a thread, whose peak leaves out the memory-mapped
  safetensors pages (page cache, shared between the ranks);
- all of it above a baseline process that only imports titanite.run.trainer (torch, transformers),
  measured by the same wrapper.

Next to each row: the target, and `titanite estimate`'s per-rank figure for the same overrides
and world size (titanite.plan.estimate, in-process), which is for the training step.

Before each run the free memory (MemAvailable, capped at --max-total-gib) is checked against N
x a rank's need (measured on N ranks already, else the estimate + 25%), plus 15%. A run that
would not fit stops every rank at the end of start-up ("stopped"), or is skipped with a note.

    .venv/bin/python benchmarks/startup.py            # the docs/performance.md table (~5 min on 2 cores)
    .venv/bin/python benchmarks/startup.py --quick    # 2 layers, hidden 512, 1 and 2 ranks
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import add_model_args, machine, mark_phases, proc_status

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
RECORD_ENV = "TITANITE_STARTUP_BENCH_RECORD"
STOP_ENV = "TITANITE_STARTUP_BENCH_STOP"  # "1": every rank stops at the end of start-up
LOG_LINE = re.compile(r"model qwen3: .* parameters")


# -- inside each rank ---------------------------------------------------------------------------


def rank_child(argv: list[str]) -> None:
    """One rank (or the baseline): titanite.train's main, with VmHWM read at the end of
    start-up and at exit; one JSON file per rank in $TITANITE_STARTUP_BENCH_RECORD."""
    record = Path(os.environ[RECORD_ENV])
    rank = int(os.environ.get("RANK", "0"))
    peak_anon = [0]
    phase = ["start-up"]
    phases: dict[str, int] = {}  # the sampled RssAnon peak of each phase of the run

    def sample() -> None:
        while True:
            anon = proc_status()["RssAnon"]
            peak_anon[0] = max(peak_anon[0], anon)
            phases[phase[0]] = max(phases.get(phase[0], 0), anon)
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    import titanite.run.trainer

    if argv == ["--baseline"]:
        (record / "baseline.json").write_text(json.dumps({"exit": {**proc_status(), "peak_anon": peak_anon[0]}}))
        return
    marks: dict = {}
    start = titanite.run.trainer.Trainer._start

    def timed_start(self, ready):
        start(self, ready)  # ends with the "model qwen3: ... parameters" log line
        marks["startup"] = {"t": time.time(), **proc_status(), "peak_anon": peak_anon[0]}
        if os.environ.get(STOP_ENV) == "1":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()  # no rank leaves while another is still in a start-up collective
            (record / f"rank-{rank}.json").write_text(json.dumps(marks))
            logging.shutdown()
            sys.stderr.flush()
            os._exit(0)

    save = titanite.run.trainer.Trainer._save

    def marked_save(self):
        marks.setdefault("before_save", {"t": time.time(), **proc_status(), "peak_anon": peak_anon[0]})
        return save(self)

    titanite.run.trainer.Trainer._start = timed_start
    titanite.run.trainer.Trainer._save = marked_save
    mark_phases(titanite.run.trainer, phase)
    from titanite.parallel.distributed import exit_process
    from titanite.train import main

    code = main(argv)
    marks["exit"] = {"t": time.time(), **proc_status(), "peak_anon": peak_anon[0]}
    marks["phases"] = dict(phases)
    (record / f"rank-{rank}.json").write_text(json.dumps(marks))
    exit_process(code)


# -- the inputs ---------------------------------------------------------------------------------


def hf_config(args: argparse.Namespace):
    import transformers

    return transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=4096, tie_word_embeddings=args.tied)


def count(args: argparse.Namespace) -> tuple[int, int]:
    """(parameters, elements of the largest tensor) of the transformers model, built on meta."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(hf_config(args))
    return sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters())


def make_model(args: argparse.Namespace) -> None:
    """Runs in its own process, so the benchmark's process never holds the model."""
    import torch
    import transformers

    if args.inits == ["random"]:  # the config.json is all a random init reads
        hf_config(args).save_pretrained(args.out)
        return
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(hf_config(args)).float()
    model.save_pretrained(args.out)  # safetensors


def make_inputs(root: Path, args: argparse.Namespace, env: dict[str, str]) -> tuple[Path, Path]:
    folder, data = root / "model", root / "data.txt"
    argv = [sys.executable, __file__, "--make-model", "--out", str(folder), "--inits", *args.inits] + shape_argv(args)
    subprocess.run(argv, check=True, env=env, cwd=REPO, capture_output=True)
    words = "the model is built on the meta device and then every rank holds all of it".split()
    data.write_text("".join(f"{i} " + " ".join(words[i % 7:] + words[:i % 7]) + ".\n" for i in range(2000)))
    # tokenized once into the shared store, so no run pays (or races for) the first tokenization
    subprocess.run([sys.executable, "-m", "titanite.cli", "data", "prepare", "--workers", "1",
                    f"--data.path={data}", "--data.tokenizer=qwen3", f"--data.seq_len={args.seq_len}",
                    f"--model.hf_path={folder}"], check=True, env=env, cwd=REPO, capture_output=True)
    return folder, data


def shape_argv(args: argparse.Namespace) -> list[str]:
    return ["--vocab", str(args.vocab), "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
            "--layers", str(args.layers), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
            "--head-dim", str(args.head_dim)] + (["--tied"] if args.tied else [])


def overrides(folder: Path, data: Path, out: Path, init: str, args: argparse.Namespace) -> list[str]:
    return [f"--{k}={v}" for k, v in {
        "job.output_dir": out, "job.device": "cpu", "model.hf_path": folder, "model.init": init,
        "data.path": data, "data.tokenizer": "qwen3", "data.seq_len": args.seq_len, "training.batch_size": 1,
        "training.steps": args.steps, "checkpoint.export_hf": "false", "checkpoint.interval": 0,
        "metrics.peak_tflops": 1, "metrics.progress_bar": "off"}.items()]


# -- the runs -----------------------------------------------------------------------------------


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def launch(ranks: int, train_argv: list[str], record: Path, env: dict[str, str], timeout: float,
           startup_only: bool) -> dict:
    """One run; returns the launcher's timings and every rank's record."""
    record.mkdir(parents=True)
    wrapper = [__file__, "--rank-child"] + train_argv
    if ranks == 1:
        argv = [sys.executable] + wrapper
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] + wrapper
    env = {**env, RECORD_ENV: str(record), STOP_ENV: "1" if startup_only else "0"}
    lines: list[str] = []
    seen: dict[str, float] = {}
    t0 = time.time()
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "log_line" not in seen and LOG_LINE.search(line):
                seen["log_line"] = time.time()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    reader.join(5)
    t_end = time.time()
    if rc != 0:
        sys.exit(f"the {ranks}-rank run failed ({rc}):\n{''.join(lines)[-4000:]}")
    if "log_line" not in seen:
        sys.exit(f"the {ranks}-rank run never logged 'model qwen3: ... parameters':\n{''.join(lines)[-4000:]}")
    records = [json.loads((record / f"rank-{r}.json").read_text()) for r in range(ranks)]
    return {"startup_s": seen["log_line"] - t0, "run_s": t_end - t0,
            "last_rank_ready_s": max(r["startup"]["t"] for r in records) - t0, "ranks": records}


def predicted_rank(rows: list[dict], ranks: int, when: str, key: str, guess: float) -> float:
    """A rank's rows[..]["ranks"][..][when][key] on `ranks` ranks: the largest measured on as many
    ranks (either init), else `guess`."""
    same = [x[when][key] for r in rows if r["n"] == ranks and when in r["ranks"][0] for x in r["ranks"]]
    return max(same) if same else guess


def baseline(root: Path, env: dict[str, str]) -> dict[str, int]:
    record = root / "baseline"
    record.mkdir()
    subprocess.run([sys.executable, __file__, "--rank-child", "--baseline"], check=True, cwd=REPO,
                   env={**env, RECORD_ENV: str(record)})
    return json.loads((record / "baseline.json").read_text())["exit"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-child":
        rank_child(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="hidden 512, 2 layers, MLP 1536, 1 and 2 ranks")
    p.add_argument("--ranks", type=int, nargs="+", help="world sizes (default 1 2 4 8; --quick: 1 2)")
    p.add_argument("--inits", nargs="+", default=["random", "pretrained"], choices=("random", "pretrained"))
    add_model_args(p)
    p.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
    p.add_argument("--steps", type=int, default=1, help="training steps per run")
    p.add_argument("--estimate-check", action="store_true",
                   help="the estimate against the measured peak: Qwen3-0.6B's shapes (28 layers, hidden 1024, "
                        "MLP 3072, 16/8 heads of 128, tied), fp32, batch 1 x 256, 2 steps, random init, 1 and 2 ranks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--max-total-gib", type=float, default=20.0,
                   help="skip a run whose ranks together would need more than this (or than MemAvailable)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--make-model", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 512, 1536, 2, 8, 4
    if args.estimate_check:
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 1024, 3072, 28, 16, 8
        args.head_dim, args.tied, args.seq_len, args.steps, args.inits = 128, True, 256, 2, ["random"]
        args.ranks = args.ranks or [1, 2]
    args.ranks = args.ranks or ([1, 2] if args.quick else [1, 2, 4, 8])
    if args.make_model:
        make_model(args)
        return

    from titanite.core.config import load_config
    from titanite.plan import estimate

    print(machine())
    params, largest = count(args)
    model_bytes = 4 * params
    print(f"model: hidden {args.hidden}, {args.layers} layers, MLP {args.intermediate}, {args.heads} query / "
          f"{args.kv_heads} key-value heads of {args.head_dim}, {'tied' if args.tied else 'untied'} vocabulary {args.vocab:,}: {params:,} "
          f"parameters ({model_bytes / GIB:.2f} GiB in fp32), largest tensor {largest:,} elements "
          f"({4 * largest / GIB:.2f} GiB)", flush=True)
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="titanite-startup-bench-") as tmp:
        root = Path(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(root / "cache"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        folder, data = make_inputs(root, args, env)
        print(f"inputs written in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        base = baseline(root, env)
        print(f"baseline (import titanite.run.trainer): VmHWM {base['VmHWM'] / GIB:.2f} GiB, RssAnon "
              f"{base['RssAnon'] / GIB:.2f} GiB", flush=True)
        for init in args.inits:
            for ranks in args.ranks:
                out = root / f"run-{init}-{ranks}"
                train_argv = overrides(folder, data, out, init, args)
                avail = mem_available()
                room = min(avail, args.max_total_gib * GIB)
                est = estimate(load_config(None, train_argv), ranks).total
                # the whole run: its VmHWM counts the shared pages (libraries, the mmapped
                # weights) in every rank, so this overestimates; unmeasured, the estimate + 25%
                need_run = 1.15 * ranks * predicted_rank(rows, ranks, "exit", "VmHWM",
                                                         1.25 * est / 1.15 + base["VmHWM"])
                # start-up only: every rank's anonymous memory, and the weights' page cache once
                need_startup = 1.1 * (ranks * predicted_rank(rows, ranks, "startup", "peak_anon",
                                                             model_bytes + base["RssAnon"])
                                      + (model_bytes if init == "pretrained" else 0))
                if need_run <= room:
                    startup_only = False
                elif need_startup <= room:
                    startup_only = True
                    notes.append(f"{init} on {ranks} ranks stopped at the end of start-up: the whole run would "
                                 f"need ~{need_run / GIB:.1f} GiB, start-up ~{need_startup / GIB:.1f} GiB; "
                                 f"{avail / GIB:.1f} GiB available, cap {args.max_total_gib:g} GiB")
                else:
                    notes.append(f"skipped {init} on {ranks} ranks: start-up alone would need "
                                 f"~{need_startup / GIB:.1f} GiB; {avail / GIB:.1f} GiB available, "
                                 f"cap {args.max_total_gib:g} GiB")
                    print(notes[-1], file=sys.stderr, flush=True)
                    continue
                r = launch(ranks, train_argv, root / f"record-{init}-{ranks}", env, args.timeout, startup_only)
                shutil.rmtree(out, ignore_errors=True)  # the end-of-run checkpoint: ~16 bytes per parameter
                r.update(init=init, n=ranks, estimate=est, avail_before=avail, startup_only=startup_only)
                rows.append(r)
                print(f"  {init} x {ranks}: start-up {r['startup_s']:.1f} s, launch to exit {r['run_s']:.1f} s, "
                      f"start-up VmHWM {max(x['startup']['VmHWM'] for x in r['ranks']) / GIB:.2f} GiB",
                      file=sys.stderr, flush=True)

    def above(r: dict, when: str, key: str, pick=max) -> float:
        return pick(x[when][key] for x in r["ranks"]) - base[key]

    print("\nGiB per rank, the largest over a run's ranks, above the baseline; target = 1.1 x (16 B x "
          "parameters / N + the largest tensor in fp32); estimate = `titanite estimate` (the training step)")
    print("\n| init | ranks | start-up s | run s | peak RSS at start-up | of which anonymous (sampled) "
          "| peak RSS through the step | peak RSS, whole run (with checkpoint) | target | start-up / target "
          "| through the step / target | estimate |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        n = r["n"]
        target = 1.1 * (16 * params / n + 4 * largest)
        s, a = above(r, "startup", "VmHWM"), above(r, "startup", "peak_anon")
        if r["startup_only"]:
            run_s = step = whole = step_ratio = "stopped"
        else:
            st, w = above(r, "before_save", "VmHWM"), above(r, "exit", "VmHWM")
            run_s, step, whole = f"{r['run_s']:.1f}", f"{st / GIB:.2f}", f"{w / GIB:.2f}"
            step_ratio = f"{st / target:.2f}x"
        print(f"| {r['init']} | {n} | {r['startup_s']:.1f} | {run_s} | {s / GIB:.2f} | {a / GIB:.2f} | "
              f"{step} | {whole} | {target / GIB:.2f} | {s / target:.2f}x | {step_ratio} | "
              f"{r['estimate'] / GIB:.2f} |")
    print(f"\nfull fp32 model: {model_bytes / GIB:.2f} GiB; every rank's start-up peak (GiB above baseline):")
    for r in rows:
        print(f"  {r['init']} x {r['n']}: " + ", ".join(f"{(x['startup']['VmHWM'] - base['VmHWM']) / GIB:.2f}"
                                                    for x in r["ranks"])
              + (f"; anonymous through the step (sampled) {above(r, 'before_save', 'peak_anon') / GIB:.2f}"
                 if not r["startup_only"] else "")
              + f"  (last rank ready {r['last_rank_ready_s']:.1f} s; "
              f"{r['avail_before'] / GIB:.1f} GiB available before)")
    print("\nthe estimate against the measured peak RSS through the training steps (VmHWM when the "
          "end-of-run save begins, above the baseline), GiB per rank:")
    print("\n| init | ranks | estimate | measured (largest rank) | estimate / measured |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if not r["startup_only"]:
            st = above(r, "before_save", "VmHWM")
            print(f"| {r['init']} | {r['n']} | {r['estimate'] / GIB:.2f} | {st / GIB:.2f} | {r['estimate'] / st:.3f} |")
    print("\nsampled anonymous RSS peak of each phase, GiB above the baseline's (rank 0):")
    for r in rows:
        phases = r["ranks"][0].get("phases", {})
        print(f"  {r['init']} x {r['n']}: " + ", ".join(f"{k} {(v - base['RssAnon']) / GIB:.2f}" for k, v in phases.items()))
    for note in notes:
        print(note)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

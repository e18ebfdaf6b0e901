"""Data pipeline benchmark: prepare throughput, start-up against corpus size, loader throughput.

    .venv/bin/python benchmarks/data.py                 # the three tables (~10 min on 2 cores)
    .venv/bin/python benchmarks/data.py --big-tokens 20e6 --only startup

1. Prepare: tokens/s of `titanite data prepare` with 1 and 2 workers against `tokenizers`' own
   `encode_batch` on the same documents, each in a fresh process with the Rust tokenizer held
   to one thread (RAYON_RS_NUM_CPUS=1), so "per worker" means per core.
2. Start-up: launch to the first logged step, and the run's own peak RSS (metrics.jsonl's
   host_peak_rss_gib), of a 2-step run of the demo's model (configs/demo.toml) on a prepared
   store of ~1M tokens and one of ~100M (`--big-tokens`), the stores made once beforehand;
   the ratio big / small is what grows with the corpus.
3. Loader: tokens/s the loader serves (store, stream packing; store, documents packing;
   streaming) at the demo's batch shape, against the tokens/s the demo's training step consumes
   on this machine (measured here too, from its metrics.jsonl).

The corpus is Python's standard library sources (as the demo's data), repeated into JSON-lines
files for the large one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def stdlib_docs(limit_chars: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for f in sorted(root.glob("**/*.py")):
        if {"site-packages", "dist-packages"} & set(f.relative_to(root).parts):
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(text)
            total += len(text)
        if total >= limit_chars:
            break
    return docs


def write_jsonl(folder: Path, docs: list[str], copies: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for c in range(copies):
        with open(folder / f"part-{c:04d}.jsonl", "w") as f:
            for d in docs:
                f.write(json.dumps({"text": f"# copy {c}\n{d}"}) + "\n")
    return folder


def _child(code: str, env_extra: dict | None = None) -> dict:
    env = {**os.environ, "RAYON_RS_NUM_CPUS": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


RAW = """
import json, time, sys
from pathlib import Path
from titanite.data import load_tokenizer
tok = load_tokenizer("qwen3")
docs = [json.loads(l)["text"] for f in sorted(Path({folder!r}).glob("*.jsonl")) for l in open(f)]
start = time.perf_counter(); n = 0
for i in range(0, len(docs), 256):
    n += sum(len(x) + 1 for x in tok.encode_batch(docs[i:i + 256]))
print(json.dumps({{"tokens": n, "seconds": time.perf_counter() - start}}))
"""

PREPARE = """
import json, time, logging
from pathlib import Path
from titanite.core.config import DataConfig
from titanite.data import load_tokenizer, prepare
tok = load_tokenizer("qwen3")
start = time.perf_counter()
s = prepare.prepare(DataConfig(path={folder!r}, tokenizer="qwen3"), tok, Path({out!r}), workers={workers})
print(json.dumps({{"tokens": s.num_tokens, "seconds": time.perf_counter() - start}}))
"""


def bench_prepare(root: Path, docs: list[str], copies: int) -> list[str]:
    folder = write_jsonl(root / "prep-src", docs, copies)
    raw = _child(RAW.format(folder=str(folder)))
    rows = [f"| tokenizers encode_batch (1 thread) | {raw['tokens']:,} | {raw['seconds']:.1f} | "
            f"{raw['tokens'] / raw['seconds']:,.0f} | 1.00x |"]
    for workers in (1, 2):
        r = _child(PREPARE.format(folder=str(folder), out=str(root / f"prep-{workers}"), workers=workers))
        rate = r["tokens"] / r["seconds"]
        per_worker = rate / workers / (raw["tokens"] / raw["seconds"])
        rows.append(f"| titanite data prepare, {workers} worker{'s' if workers > 1 else ''} | {r['tokens']:,} | "
                    f"{r['seconds']:.1f} | {rate:,.0f} | {per_worker:.2f}x per worker |")
    return ["| tokenizer | tokens | s | tokens/s | vs encode_batch |", "| --- | ---: | ---: | ---: | ---: |", *rows]


def _train(store_dir: Path, out: Path, extra: list[str] = ()) -> tuple[float, float, list[dict]]:
    """Launch a tiny training run on a named store: (seconds to the first step, peak RSS GiB, rows)."""
    cmd = [sys.executable, "-m", "titanite.train", "--config", str(REPO / "configs/demo.toml"),
           f"--job.output_dir={out}", f"--data.path={store_dir}", "--training.steps=2", "--training.warmup_steps=0",
           "--metrics.log_interval=1", "--data.on_decode_error=error",  # as the stores were prepared
           "--checkpoint.export_hf=false", "--metrics.progress_bar=lines", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    first = None
    for line in proc.stderr:
        if first is None and "step 1/" in line:
            first = time.perf_counter() - start
    proc.wait()
    assert proc.returncode == 0 and first is not None, f"training exited {proc.returncode}"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return first, rows[-1]["host_peak_rss_gib"], rows  # the run's own peak RSS


def bench_startup(root: Path, docs: list[str], big_tokens: float) -> tuple[list[str], float]:
    sys.path.insert(0, str(REPO))
    from titanite.core.config import DataConfig
    from titanite.data import load_tokenizer, prepare

    tok = load_tokenizer("qwen3")
    small_src = write_jsonl(root / "small-src", docs, 1)
    small = prepare.prepare(DataConfig(path=str(small_src), tokenizer="qwen3"), tok, root / "small-store", workers=2)
    copies = max(1, round(big_tokens / small.num_tokens))
    big_src = write_jsonl(root / "big-src", docs, copies)
    t = time.perf_counter()
    big = prepare.prepare(DataConfig(path=str(big_src), tokenizer="qwen3"), tok, root / "big-store", workers=2)
    prep_s = time.perf_counter() - t
    rows = ["| store | tokens | store on disk | launch to first step (s) | peak RSS (GiB) |", "| --- | ---: | ---: | ---: | ---: |"]
    results = {}
    _train(small.path, root / "run-warm-up")  # the first run measures and caches the CPU peak: not timed
    for name, s in (("~1M tokens", small), ("~100M tokens", big)):
        first, rss, metrics = _train(s.path, root / f"run-{name[1:4].strip()}")
        size = sum(f.stat().st_size for f in s.path.iterdir()) / 2**20
        results[name] = (first, rss, metrics)
        rows.append(f"| {name} | {s.num_tokens:,} | {size:,.0f} MiB | {first:.1f} | {rss:.2f} |")
    (f1, r1, _), (f2, r2, _) = results.values()
    rows.append(f"| ratio big / small | {big.num_tokens / small.num_tokens:.0f}x | | {f2 / f1:.2f}x | {r2 / r1:.2f}x |")
    rows.append(f"\n(the ~100M-token store took {prep_s:.0f} s to prepare with 2 workers)")
    step_tokens_per_s = results["~1M tokens"][2][-1]["tokens_per_sec"]
    return rows, step_tokens_per_s


def bench_loader(root: Path, docs: list[str], step_tokens_per_s: float) -> list[str]:
    sys.path.insert(0, str(REPO))
    from titanite.core.config import DataConfig
    from titanite.data import load_tokenizer
    from titanite.data.loader import make_loader

    tok = load_tokenizer("qwen3")
    src = write_jsonl(root / "loader-src", docs, 1)
    rows = ["| loader (4 x 256 tokens per batch) | tokens/s | vs the training step's tokens/s |", "| --- | ---: | ---: |"]
    for name, kw in (("store, stream packing", {}), ("store, documents packing", {"packing": "documents"}),
                     ("streaming (tokenizes as it goes)", {"streaming": True})):
        ld = make_loader(DataConfig(path=str(src), tokenizer="qwen3", seq_len=256, cache_dir=str(root / "cache"), **kw),
                         tok, 4, 0)
        ld.next_batch()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < 3.0:
            n += ld.next_batch()["input_ids"].numel()
        rate = n / (time.perf_counter() - start)
        rows.append(f"| {name} | {rate:,.0f} | {rate / step_tokens_per_s:,.0f}x |")
    rows.append(f"\n(the training step: the demo's model and batch, {step_tokens_per_s:,.0f} tokens/s on this machine)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("prepare", "startup", "loader"))
    parser.add_argument("--big-tokens", type=float, default=100e6)
    parser.add_argument("--prepare-copies", type=int, default=10, help="corpus copies for the prepare table (~1M tokens each)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="titanite-data-bench-"))
    os.environ.setdefault("XDG_CACHE_HOME", str(root / "xdg"))
    docs = stdlib_docs(4_000_000)  # ~1M Qwen3 tokens
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; corpus {len(docs)} files")
    step_rate = None
    if args.only in (None, "prepare"):
        print("\n".join(["", "## prepare", *bench_prepare(root, docs, args.prepare_copies)]), flush=True)
    if args.only in (None, "startup", "loader"):
        rows, step_rate = bench_startup(root, docs, args.big_tokens if args.only != "loader" else 2e6)
        if args.only != "loader":
            print("\n".join(["", "## start-up", *rows]), flush=True)
    if args.only in (None, "loader"):
        print("\n".join(["", "## loader", *bench_loader(root, docs, step_rate)]), flush=True)


if __name__ == "__main__":
    main()

"""Training step throughput of the two backends and of a hand-written loop, side by side.

The same ~20M-parameter Qwen3 (hidden 256, 4 layers, 4 query / 2 key-value heads of 64, MLP
768, a 32,000-row vocabulary, untied head) trains on the same batches of 8 x 256 tokens with:

- hand loop: a plain PyTorch loop around transformers' Qwen3ForCausalLM (forward, fp32
  cross-entropy, backward, clip, AdamW): the floor for framework overhead;
- titanite hf: `model.spec = "hf"` through titanite's `Trainer.train_step` (data loader, loss
  normalisation, clipping, NaN check, schedule, optimizer, kernels from `[kernels]`);
- titanite qwen3: the same with the native model and its default kernels (on CPU: the
  reference ops, SDPA, and the chunked loss, which recomputes the head matmul in backward
  to never hold the [tokens, vocab] logits);
- titanite qwen3, loss = reference: the native model with the loss taken from materialised
  logits, as transformers and the hand loop do.

All rows start from the same weights (titanite's seeded init, which both backends draw alike;
the hand loop copies the hf model's) and see the same token windows, so their first losses
agree (printed). Each round runs one step of every row in turn (the order rotated each round),
so machine noise hits all rows alike; a row's time is its fastest round (noise only ever adds
time). Both wall time and this
process's CPU time are reported, and tokens/s and MFU from each: on a shared machine the CPU
time of a single-threaded run (the default) is the steady measure of what a step costs, and on
an idle machine the two agree. fp32 runs plain; bf16 is autocast with fp32 weights, as
`training.mixed_precision = "bf16"` does. MFU counts matmul and attention FLOPs (titanite's
formula) against a 2048^3 GEMM measured here.

    .venv/bin/python benchmarks/backends.py                 # the docs/performance.md table
    .venv/bin/python benchmarks/backends.py --dtypes bf16 --rounds 8 --compile
    .venv/bin/python benchmarks/backends.py --dtypes fp32 --profile /tmp/trace   # op tables + traces
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from titanite.config import load_config
from titanite.models.flops import flops_per_token
from titanite.kernels import IGNORE_INDEX
from titanite.trainer import Trainer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_model_folder(root: Path, args: argparse.Namespace) -> Path:
    """config.json (no weights: random init) and a byte-level BPE tokenizer trained on a slice of
    the standard library, smaller than the model's vocabulary (rows past it are never looked up,
    but the head still computes all of them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = root / "model"
    folder.mkdir()
    transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ).to_json_file(folder / "config.json")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:80]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder


def titanite_trainer(spec: str, folder: Path, root: Path, dtype: str, args: argparse.Namespace,
                     **extra: str) -> Trainer:
    overrides = {
        "job.output_dir": root / f"{spec}-{dtype}-{len(list(root.iterdir()))}", "model.spec": spec,
        "model.hf_path": folder, "parallelism.compile": str(args.compile).lower(), **extra,
        "model.init": "random", "data.path": root / "data.jsonl", "data.seq_len": args.seq_len,
        "training.batch_size": args.batch_size, "training.steps": 10**6, "training.lr": 1e-4,
        "training.mixed_precision": "bf16" if dtype == "bf16" else "none",
        "metrics.peak_tflops": 1.0, "metrics.progress_bar": "off", "checkpoint.export_hf": False,
    }
    return Trainer(load_config(None, [f"--{k}={v}" for k, v in overrides.items()]))


class HandLoop:
    """The floor: transformers' model in the plainest correct training loop."""

    def __init__(self, weights_from: Trainer, dtype: str) -> None:
        config = weights_from.model.hf.config
        self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                                   dtype=torch.float32)
        self.model.load_state_dict(weights_from.model.hf.state_dict())
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                     weight_decay=0.1, foreach=True)
        self.autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16"
                         else contextlib.nullcontext())
        self.loader = copy.deepcopy(weights_from.loader)  # the same windows, in the same order

    def train_step(self) -> tuple[float, float]:
        b = self.loader.next_batch()
        with self.autocast:
            logits = self.model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach()), float(norm)


def titanite_step(trainer: Trainer):
    def step() -> tuple[float, float]:
        out = trainer.train_step()
        trainer.step += 1
        return out
    return step


def time_step(step) -> tuple[float, float]:
    """(wall, process CPU) seconds of one step. The CPU time (all threads of this process) is
    what the step itself cost, whatever else the machine was running."""
    w, c = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - w, time.process_time() - c


def build_rows(folder: Path, root: Path, dtype: str, args: argparse.Namespace) -> tuple[dict, Trainer]:
    hf = titanite_trainer("hf", folder, root, dtype, args)
    native = titanite_trainer("qwen3", folder, root, dtype, args)
    native_ref = titanite_trainer("qwen3", folder, root, dtype, args, **{"kernels.loss": "reference"})
    rows = {"hand loop": HandLoop(hf, dtype).train_step, "titanite hf": titanite_step(hf),
            "titanite qwen3": titanite_step(native),
            "titanite qwen3, loss = reference": titanite_step(native_ref)}
    return rows, native


def gemm_peak(dtype: torch.dtype, n: int = 2048, tries: int = 5) -> tuple[float, float]:
    """(wall, CPU-time) FLOP/s of the fastest of a few n^3 GEMMs: the practical peak for MFU."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    times = [time_step(lambda: a @ b) for _ in range(tries)]
    return 2 * n**3 / min(w for w, _ in times), 2 * n**3 / min(c for _, c in times)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    logging.getLogger("titanite").setLevel(logging.WARNING)
    tokens = args.batch_size * args.seq_len
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = make_model_folder(root, args)
        for dtype in args.dtypes:
            rows, native = build_rows(folder, root, dtype, args)
            first = {name: step() for name, step in rows.items()}  # the same first window: equal losses
            for name, step in rows.items():
                for _ in range(args.warmup - 1):
                    step()
            per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
            names = list(rows)
            for r in range(args.rounds):
                # Rotated each round, so no row always runs first (or right after the same row).
                for name in names[r % len(names):] + names[:r % len(names)]:
                    per_round[name].append(time_step(rows[name]))
            peak, cpu_peak = gemm_peak(DTYPES[dtype])
            fpt = flops_per_token(native.model.args, args.seq_len)
            n_params = sum(p.numel() for p in native.model.parameters())
            for name in rows:
                t = min(w for w, _ in per_round[name])
                cpu_t = min(c for _, c in per_round[name])
                results[(dtype, name)] = {
                    "s_per_step": t, "tokens_per_sec": tokens / t, "mfu": fpt * tokens / t / peak,
                    "cpu_s_per_step": cpu_t, "tokens_per_cpu_s": tokens / cpu_t,
                    "mfu_cpu": fpt * tokens / cpu_t / cpu_peak, "first_loss": first[name][0]}
            report(dtype, results, n_params, (peak, cpu_peak), args)


def report(dtype: str, results: dict, n_params: int, peaks: tuple[float, float], args: argparse.Namespace) -> None:
    r = {name: v for (d, name), v in results.items() if d == dtype}
    hand, hf, native = r["hand loop"], r["titanite hf"], r["titanite qwen3"]
    print(f"\n{dtype}: {n_params / 1e6:.1f}M parameters, batch {args.batch_size} x {args.seq_len}, "
          f"{args.threads} thread(s), fastest of {args.rounds} rounds, 2048^3 GEMM peak "
          f"{peaks[0] / 1e9:.0f} GFLOP/s (wall), {peaks[1] / 1e9:.0f} GFLOP/s (CPU time)"
          f"{', blocks compiled' if args.compile else ''}")
    print("| row | wall s/step | tokens/s | MFU | CPU s/step | tokens/CPU-s | MFU (CPU) | vs hand loop (CPU) "
          "| first loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, v in r.items():
        print(f"| {name} | {v['s_per_step']:.2f} | {v['tokens_per_sec']:,.0f} | {100 * v['mfu']:.1f}% | "
              f"{v['cpu_s_per_step']:.2f} | {v['tokens_per_cpu_s']:,.0f} | {100 * v['mfu_cpu']:.1f}% | "
              f"{hand['cpu_s_per_step'] / v['cpu_s_per_step']:.3f}x | {v['first_loss']:.6f} |")
    native_ref = r["titanite qwen3, loss = reference"]
    for what, key in (("wall", "s_per_step"), ("CPU", "cpu_s_per_step")):
        print(f"{what} time: titanite hf overhead over the hand loop {100 * (hf[key] / hand[key] - 1):+.1f}% "
              f"(target <= 3%); native / hf speed {hf[key] / native[key]:.2f}x, with loss = reference "
              f"{hf[key] / native_ref[key]:.2f}x (target >= 1.3x in bf16)")
    sys.stdout.flush()


def profile(args: argparse.Namespace) -> None:
    """Chrome trace and op table of a few native and hf steps (the first dtype in --dtypes)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.set_num_threads(args.threads)
    dtype = args.dtypes[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = make_model_folder(root, args)
        for spec in ("qwen3", "hf"):
            trainer = titanite_trainer(spec, folder, root, dtype, args)
            step = titanite_step(trainer)
            for _ in range(args.warmup):
                step()
            with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
                for _ in range(args.rounds):
                    step()
            print(f"\n== {spec} ({dtype}): top ops by self CPU time over {args.rounds} steps")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            prof.export_chrome_trace(str(Path(args.profile).with_suffix(f".{spec}.json")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--rounds", type=int, default=4,
                   help="timed rounds, each one step of every row, in an order rotated per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per row first (the first is also "
                                                          "the loss check)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (default 1: on a shared machine, idle OpenMP threads spin "
                        "and inflate CPU time; one thread's CPU time is the steady measure)")
    p.add_argument("--compile", action="store_true", help="parallelism.compile = true for the titanite rows")
    p.add_argument("--profile", default="", help="instead of the table: profile native and hf, "
                                                 "write Chrome traces next to this path")
    args = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {args.threads} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    if args.profile:
        profile(args)
    else:
        run(args)


if __name__ == "__main__":
    main()

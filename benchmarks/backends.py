"""Training step throughput of the two backends and of a hand-written loop, side by side.

The same ~20M-parameter Qwen3 (hidden 256, 4 layers, 4 query / 2 key-value heads of 64, MLP
768, a 32,000-row vocabulary, untied head) trains on the same batches of 8 x 256 tokens with:

- hand loop: a plain PyTorch loop around transformers' Qwen3ForCausalLM (forward, fp32
  cross-entropy, backward, clip, fused AdamW as titanite uses): the floor for framework
  overhead; and the same loop with foreach AdamW, to show what the fused optimizer is worth;
- titanite hf: `model.spec = "hf"` through titanite's `Trainer.train_step` (data loader, loss
  normalisation, clipping, NaN check, schedule, optimizer, kernels from `[kernels]`);
- titanite qwen3: the same with the native model and its default kernels (on CPU: the
  reference ops, SDPA, and `loss = "auto"`, which picks the plain fused cross-entropy unless one
  micro-batch's logits would take more than 10% of the device's memory);
- titanite qwen3, loss = chunked / reference: the two losses `auto` chooses between, explicitly
  (chunked recomputes the head matmul in backward to never hold the [tokens, vocab] logits);
- titanite hf, loss = chunked / reference: the transformers backend with the same two losses
  (the loss op runs on its final hidden states and head weight, kernels/hf.py), for the memory
  the chunked loss saves on either backend (peak RSS of the row's process, in MiB);
- titanite qwen3, host read every step: the default row, but reading the loss and gradient norm
  on the host after every step, as the trainer did before it kept them on the device between
  logging steps (on a CPU, where every op already runs synchronously, the two rows should tie;
  on an accelerator the read drains the queue every step).

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

    .venv/bin/python benchmarks/backends.py --dtypes fp32   # the docs/performance.md table
    .venv/bin/python benchmarks/backends.py --dtypes fp32 --preset demo   # configs/demo.toml's shapes
    .venv/bin/python benchmarks/backends.py --dtypes fp32 --preset demo --rows "titanite hf, loss = chunked" \
        "titanite hf, loss = reference" "titanite qwen3, loss = chunked" "titanite qwen3, loss = reference"
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
import resource
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from titanite.core.config import load_config
from titanite.kernels import IGNORE_INDEX
from titanite.models.flops import flops_per_token
from titanite.run.trainer import Trainer

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
        head_dim=args.hidden // args.heads, max_position_embeddings=4096, tie_word_embeddings=args.tied,
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
        "model.init": "random", "data.path": folder.parent / "data.jsonl", "data.seq_len": args.seq_len,
        "training.batch_size": args.batch_size, "training.steps": 10**6, "training.lr": 1e-4,
        "training.mixed_precision": "bf16" if dtype == "bf16" else "none",
        "metrics.peak_tflops": 1.0, "metrics.progress_bar": "off", "checkpoint.export_hf": False,
    }
    return Trainer(load_config(None, [f"--{k}={v}" for k, v in overrides.items()]))


class HandLoop:
    """The floor: transformers' model in the plainest correct training loop."""

    def __init__(self, weights_from: Trainer, dtype: str, fused: bool = True) -> None:
        config = weights_from.model.hf.config
        self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                                   dtype=torch.float32)
        self.model.load_state_dict(weights_from.model.hf.state_dict())
        self.model.train()
        # The same AdamW implementation as titanite's (fused), so the rows differ by the loop only;
        # the foreach row shows what the fused optimizer itself is worth.
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                     **({"fused": True} if fused else {"foreach": True}))
        self.autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16"
                         else contextlib.nullcontext())
        # the same windows, in the same order (the loader itself, not its prefetching thread)
        self.loader = copy.deepcopy(getattr(weights_from.loader, "loader", weights_from.loader))

    def train_step(self):
        b = self.loader.next_batch()
        with self.autocast:
            logits = self.model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        values = (float(loss.detach()), float(norm))
        return lambda: values


def titanite_step(trainer: Trainer, read_every_step: bool = False):
    """One trainer step. Without read_every_step the numbers stay on the device, as on the
    trainer's non-logging steps; the returned closure reads them for the first-loss check."""
    def step():
        out = trainer.train_step()
        trainer.step += 1
        if read_every_step:
            values = out.read()
            return lambda: (values["loss"], values["grad_norm"])
        return lambda: tuple(out.read()[k] for k in ("loss", "grad_norm"))
    return step


def time_step(step) -> tuple[float, float]:
    """(wall, process CPU) seconds of one step. The CPU time (all threads of this process) is
    what the step itself cost, whatever else the machine was running."""
    w, c = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - w, time.process_time() - c


ROWS = ("hand loop", "hand loop, foreach AdamW", "titanite hf", "titanite qwen3", "titanite qwen3, loss = chunked",
        "titanite qwen3, loss = reference", "titanite qwen3, host read every step", "titanite hf, loss = chunked",
        "titanite hf, loss = reference")


def build_row(name: str, folder: Path, root: Path, dtype: str, args: argparse.Namespace):
    """The step function of one row (the hand loops copy the weights of a titanite hf model)."""
    if name.startswith("hand loop"):
        return HandLoop(titanite_trainer("hf", folder, root, dtype, args), dtype, fused="foreach" not in name).train_step
    spec = name.split()[1].rstrip(",")  # "titanite hf, ..." / "titanite qwen3 ..."
    extra = {"kernels.loss": name.rsplit(" ", 1)[-1]} if "loss =" in name else {}
    return titanite_step(titanite_trainer(spec, folder, root, dtype, args, **extra),
                         read_every_step=name.endswith("every step"))


def worker(args: argparse.Namespace) -> None:
    """One row in this process: its first loss, then `--steps` timed steps (JSON on stdout)."""
    torch.set_num_threads(args.threads)
    logging.getLogger("titanite").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        step = build_row(args.worker, Path(args.folder), Path(tmp), args.dtypes[0], args)
        first = step()()
        for _ in range(args.warmup - 1):
            step()
        times = [time_step(step) for _ in range(args.steps)]
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(json.dumps({"first_loss": first[0], "wall": [w for w, _ in times], "cpu": [c for _, c in times],
                      "peak_rss_mib": peak_mib}))


def gemm_peak(dtype: torch.dtype, n: int = 2048, tries: int = 5) -> tuple[float, float]:
    """(wall, CPU-time) FLOP/s of the fastest of a few n^3 GEMMs: the practical peak for MFU."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    times = [time_step(lambda: a @ b) for _ in range(tries)]
    return 2 * n**3 / min(w for w, _ in times), 2 * n**3 / min(c for _, c in times)


def run(args: argparse.Namespace) -> None:
    """Every row in fresh processes, rounds interleaved: a process that ran another row first has
    another heap (allocator state decides how often large tensors fault their pages in on CPU),
    which made rows of one config differ by 2x in-process."""
    import subprocess

    torch.set_num_threads(args.threads)
    tokens = args.batch_size * args.seq_len
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = make_model_folder(root, args)
        for dtype in args.dtypes:
            names = [name for name in ROWS if not args.rows or name in args.rows]
            per_row: dict[str, dict] = {name: {"wall": [], "cpu": []} for name in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    argv = [sys.executable, __file__, "--worker", name, "--folder", str(folder), "--dtypes", dtype,
                            *args.passthrough]
                    out = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True)
                                     .stdout.strip().splitlines()[-1])
                    per_row[name]["first_loss"] = out["first_loss"]
                    per_row[name]["wall"] += out["wall"]
                    per_row[name]["cpu"] += out["cpu"]
                    per_row[name]["peak_rss_mib"] = max(per_row[name].get("peak_rss_mib", 0), out["peak_rss_mib"])
            peak, cpu_peak = gemm_peak(DTYPES[dtype])
            probe = titanite_trainer("qwen3", folder, root, dtype, args)
            fpt = flops_per_token(probe.model.args, args.seq_len)
            n_params = sum(p.numel() for p in probe.model.parameters())
            probe.close()
            for name, v in per_row.items():
                t, cpu_t = min(v["wall"]), min(v["cpu"])
                results[(dtype, name)] = {
                    "s_per_step": t, "tokens_per_sec": tokens / t, "mfu": fpt * tokens / t / peak,
                    "cpu_s_per_step": cpu_t, "tokens_per_cpu_s": tokens / cpu_t,
                    "mfu_cpu": fpt * tokens / cpu_t / cpu_peak, "first_loss": v["first_loss"],
                    "peak_rss_mib": v["peak_rss_mib"]}
            report(dtype, results, n_params, (peak, cpu_peak), args)


def report(dtype: str, results: dict, n_params: int, peaks: tuple[float, float], args: argparse.Namespace) -> None:
    r = {name: v for (d, name), v in results.items() if d == dtype}
    first_row = next(iter(r.values()))
    print(f"\n{dtype}: {n_params / 1e6:.1f}M parameters, batch {args.batch_size} x {args.seq_len}, "
          f"{args.threads} thread(s), fastest step of {args.rounds} processes x {args.steps} steps per row, 2048^3 GEMM peak "
          f"{peaks[0] / 1e9:.0f} GFLOP/s (wall), {peaks[1] / 1e9:.0f} GFLOP/s (CPU time)"
          f"{', blocks compiled' if args.compile else ''}")
    print(f"| row | wall s/step | tokens/s | MFU | CPU s/step | tokens/CPU-s | MFU (CPU) | vs {'hand loop' if 'hand loop' in r else 'first row'} (CPU) "
          "| first loss | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, v in r.items():
        print(f"| {name} | {v['s_per_step']:.2f} | {v['tokens_per_sec']:,.0f} | {100 * v['mfu']:.1f}% | "
              f"{v['cpu_s_per_step']:.2f} | {v['tokens_per_cpu_s']:,.0f} | {100 * v['mfu_cpu']:.1f}% | "
              f"{r.get('hand loop', first_row)['cpu_s_per_step'] / v['cpu_s_per_step']:.3f}x | {v['first_loss']:.6f} | "
              f"{v['peak_rss_mib']:,.0f} |")
    if set(ROWS) - set(r):  # a --rows subset: the table only (ratios against its first row)
        sys.stdout.flush()
        return
    hand, hf, native = r["hand loop"], r["titanite hf"], r["titanite qwen3"]
    chunked, reference = r["titanite qwen3, loss = chunked"], r["titanite qwen3, loss = reference"]
    synced = r["titanite qwen3, host read every step"]
    for what, key in (("wall", "s_per_step"), ("CPU", "cpu_s_per_step")):
        print(f"{what} time: titanite hf overhead over the hand loop {100 * (hf[key] / hand[key] - 1):+.1f}% "
              f"(target <= 3%); native / hf speed {hf[key] / native[key]:.2f}x (target >= 1.3x in bf16); "
              f"loss = auto vs the faster of chunked and reference "
              f"{min(chunked[key], reference[key]) / native[key]:.3f}x (target >= 0.98); no host read vs "
              f"a read every step {synced[key] / native[key]:.3f}x")
    sys.stdout.flush()


def profile(args: argparse.Namespace) -> None:
    """Chrome trace and op table of a few native and hf steps (the first dtype in --dtypes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

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
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each one fresh process per row, in an order rotated per round")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process")
    p.add_argument("--rows", nargs="+", default=[], choices=ROWS, metavar="ROW",
                   help="only these rows (the summary lines need the hand loop, hf and all native rows)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
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
    p.add_argument("--tied", action="store_true", help="tie the head to the embedding")
    p.add_argument("--preset", choices=("demo",), help="demo: configs/demo.toml's model and batch (the debug "
                                                       "flavor: hidden 128, 4 layers, 151,936 tied vocab, 4 x 256)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (default 1: on a shared machine, idle OpenMP threads spin "
                        "and inflate CPU time; one thread's CPU time is the steady measure)")
    p.add_argument("--compile", action="store_true", help="parallelism.compile = true for the titanite rows")
    p.add_argument("--profile", default="", help="instead of the table: profile native and hf, "
                                                 "write Chrome traces next to this path")
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    # What a worker process needs to rebuild the same rows: every option but the dtypes.
    args.passthrough = [a for a in argv if not a.startswith("--dtypes") and a not in DTYPES]
    # workers take their one row from --worker
    args.passthrough = [a for a in args.passthrough if a != "--rows" and a not in ROWS]
    if args.preset == "demo":
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 128, 384, 4, 4, 2
        args.vocab, args.tied, args.batch_size, args.seq_len = 151936, True, 4, 256
    if args.worker:
        worker(args)
        return
    print(f"machine: {platform.processor() or platform.machine()}, {args.threads} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    if args.profile:
        profile(args)
    else:
        run(args)


if __name__ == "__main__":
    main()

"""Preference tuning (DPO) side by side: titanite's three references, titanite SFT on the same
pairs, and TRL's DPOTrainer, on the same small Qwen3 and the same batch.

The rows (each in its own process, so each has its own peak RSS):

- dpo-model:       titanite DPO, preference.reference = "model", reference_path = a second
                   checkpoint (a frozen copy held beside the policy, one no-grad forward a step);
- dpo-precomputed: titanite DPO, preference.reference = "precomputed" (same second checkpoint;
                   its log-probabilities computed once at set-up, the model then dropped);
- dpo-lora:        titanite DPO with LoRA (rank 16, alpha 32, all-linear); the reference is the
                   base with the adapters switched off (no second copy);
- sft:             titanite SFT (training.objective = "lm", data.format = "chat") on the
                   conversations prompt + chosen: 2 x batch_size sequences a step, the same
                   tokens a DPO step's policy trains on;
- trl:             trl.DPOTrainer (TRL 1.16) with ref_model = the second checkpoint, set up as
                   tests/fixtures/preference.py sets it up to match titanite (fp32, CPU,
                   constant LR, no weight decay, AdamW (0.9, 0.999), clipping 1.0, no dropout,
                   no gradient checkpointing) with TRL's default optimizer on torch >= 2.8,
                   adamw_torch_fused (titanite's AdamW is fused too; the foreach one,
                   adamw_torch, allocates parameter-sized temporaries in its step);
- optional (--rows): trl-precomputed (precompute_ref_log_probs=True: the second checkpoint,
  given as ref_model, runs over every pair at set-up and is then dropped) and trl-lora (peft
  LoRA, the same rank, alpha and target modules; reference = adapters disabled).

The model: a transformers Qwen3 drawn at random and saved into a temporary folder (hidden 384,
6 layers, MLP 1152, 6 query / 2 key-value heads of 64, untied head), the reference the same
architecture with another seed. The tokenizer: the tests' tiny byte-level BPE with Qwen3's chat
template and control tokens (384-row vocabulary, so the blocks, not the head, are the work;
--vocab widens the model's embedding and head, e.g. to Qwen3's 151,936, with the same ids).

The data: conversational pairs (TRL's form) of a short user prompt and two long assistant
answers, long enough that prompt + answer exceeds data.seq_len for every row: both trainers cut
every row at seq_len (keep_start), so every sequence is exactly seq_len tokens, none padded, and
titanite (which pads each row to seq_len) and TRL (which pads to the batch's longest row) train
on the same number of tokens. One epoch holds the steps of a run.

Per row: set-up s (building the trainer: tokenizing, loading both models, for precomputed the
reference's pass over every pair), the median step time over the steps after --warmup untimed
ones (wall time, the process's CPU time beside it), tokens/s (policy tokens: 2 x pairs x
seq_len), the peak RSS of the process (VmHWM, read after the timed steps; also above a process
that only imports what the row imports, and the resident set split into anonymous and
file-backed pages), and the peak of live tensors over one more step: the tensors alive before it (every tensor Python
holds: weights, the reference, optimizer state; storages counted once) plus the highest total
of allocations the profiler records during the step. That figure leaves out what glibc keeps
of freed memory, so it carries over to a GPU's caching allocator, and it is what
`titanite estimate` models (the estimate column: titanite.plan.estimate for the row's config,
one rank). TRL's process gets titanite's host-memory policy (titanite.device.
set_host_memory_policy: freed memory kept in one process; TITANITE_KEEP_FREED_MEMORY=0 returns
it, for every row) so the RSS columns compare the trainers, not two glibc settings.

    .venv/bin/python benchmarks/preference.py                 # the docs/performance.md table (~3.5 min on 2 cores)
    .venv/bin/python benchmarks/preference.py --vocab 151936 --batch-size 1 --repeats 1   # Qwen3's vocabulary (~3 min)
    .venv/bin/python benchmarks/preference.py --quick         # a smaller model, few steps (~1 min)
    .venv/bin/python benchmarks/preference.py --rows trl trl-precomputed trl-lora dpo-model
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import apply_quick, machine, titanite_state
from preference_child import child

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
ROWS = {
    "dpo-model": "titanite DPO, live reference (second model)",
    "dpo-precomputed": "titanite DPO, precomputed reference",
    "dpo-lora": "titanite DPO + LoRA, reference = adapters off",
    "sft": "titanite SFT, prompt + chosen (2B sequences)",
    "trl": "TRL DPOTrainer, live reference (ref_model)",
    "trl-precomputed": "TRL DPOTrainer, precompute_ref_log_probs",
    "trl-lora": "TRL DPOTrainer + peft LoRA, adapters off",
}
DEFAULT_ROWS = ("dpo-model", "dpo-precomputed", "dpo-lora", "sft", "trl")
BASELINE = "dpo-model"


# -- inputs -------------------------------------------------------------------------------------


def make_inputs(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The tokenizer, the policy and reference checkpoints, the pairs and the SFT conversations."""
    sys.path.insert(0, str(REPO))
    import torch
    import transformers

    from tests.fixtures.chat import make_chat_tokenizer

    threads = torch.get_num_threads()  # tests.conftest (imported above) sets the thread count: undo
    tok_dir = make_chat_tokenizer(root / "tokenizer")
    torch.set_num_threads(threads)
    cfg = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
               num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
               head_dim=args.head_dim, max_position_embeddings=max(4096, 2 * args.seq_len),
               tie_word_embeddings=False)
    folders = {}
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
        model.save_pretrained(root / name)
        for f in tok_dir.iterdir():
            (root / name / f.name).write_bytes(f.read_bytes())
        folders[name] = root / name
    n_params = sum(p.numel() for p in model.parameters())

    words = ("the model reads tokens and predicts the next token while the optimizer lowers "
             "the loss on every step of training data in small batches").split()
    rng = random.Random(0)

    def answer() -> str:  # about a token a word over the tiny BPE: twice seq_len
        return " ".join(rng.choice(words) for _ in range(2 * args.seq_len))

    pairs = []
    for i in range(args.batch_size * (args.warmup + args.steps + 1)):
        prompt = [{"role": "user", "content": f"question {i}: what does the model do?"}]
        pairs.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": answer()}],
                      "rejected": [{"role": "assistant", "content": answer()}]})
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": p["prompt"] + p["chosen"]}) + "\n"
                                             for p in pairs))
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    shortest = min(len(tok.apply_chat_template(p["prompt"] + p[side], tokenize=True, return_dict=True)["input_ids"])
                   for p in pairs for side in ("chosen", "rejected"))
    longest_prompt = max(len(tok.apply_chat_template(p["prompt"], tokenize=True, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"]) for p in pairs)
    if shortest <= args.seq_len:
        sys.exit(f"a row has {shortest} tokens, not more than seq_len {args.seq_len}: rows would be padded")
    print(f"data: {len(pairs)} pairs (one epoch of the run), prompts <= {longest_prompt} tokens, every prompt + "
          f"answer >= {shortest} tokens, cut to {args.seq_len}")
    return {**folders, "tokenizer": tok_dir, "pairs": root / "pairs.jsonl", "chat": root / "chat.jsonl",
            "n_params": n_params}
# -- the parent ---------------------------------------------------------------------------------


def run_child(kind: str, args: argparse.Namespace, root: Path, inputs: dict, n: int) -> dict:
    out = root / f"run-{kind}-{n}"
    argv = [sys.executable, __file__, "--child", kind, "--out", str(out), "--threads", str(args.threads),
            "--spec", args.spec, "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--rank", str(args.rank),
            "--alpha", str(args.alpha), "--lr", str(args.lr), "--loss", args.loss]
    for k in ("policy", "reference", "tokenizer", "pairs", "chat"):
        argv += [f"--{k}", str(inputs[k])]
    # every run prepares its own token store (as TRL tokenizes in its constructor): set-up times
    # compare, and no run reads another's precomputed reference log-probabilities
    env = {**os.environ, "XDG_CACHE_HOME": str(root / f"cache-{kind}-{n}"), "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": str(root / f"hf-cache-{kind}-{n}"),
           "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"the {kind} run failed:\n{proc.stderr[-6000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def _floor(kind: str) -> str:
    return "imports-trl" if kind.startswith("trl") else "imports-titanite"


def measure(args: argparse.Namespace) -> None:
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="titanite-preference-bench-") as tmp:
        root = Path(tmp)
        inputs = make_inputs(root, args)
        results: dict[str, list[dict]] = {k: [] for k in args.rows}
        floors = {kind: run_child(kind, args, root, inputs, 0)["peak"] for kind in ("imports-titanite", "imports-trl")
                  if any(_floor(k) == kind for k in args.rows)}
        for rep in range(args.repeats):
            order = list(args.rows[rep % len(args.rows):]) + list(args.rows[:rep % len(args.rows)])
            for kind in order:
                r = run_child(kind, args, root, inputs, rep)
                results[kind].append(r)
                print(f"  repeat {rep + 1} {kind}: {r['process_s']:.0f} s", file=sys.stderr, flush=True)
    print(f"\nmodel: hidden {args.hidden}, {args.layers} layers, MLP {args.intermediate}, {args.heads} query / "
          f"{args.kv_heads} key-value heads of {args.head_dim}, vocabulary {args.vocab:,} (untied), "
          f"{inputs['n_params']:,} parameters, fp32, titanite model.spec {args.spec}, kernels.loss {args.loss}; "
          f"{args.batch_size} pairs x "
          f"{args.seq_len} tokens a step ({2 * args.batch_size} sequences; SFT: {2 * args.batch_size} sequences of "
          f"prompt + chosen); {args.threads} thread(s); LoRA rank {args.rank}, alpha {args.alpha:g}, all-linear; "
          f"median of {args.steps} steps after {args.warmup} untimed, over {args.repeats} process(es) per row")
    print("first losses (titanite's three DPO rows start from the same policy, reference and batch; LoRA's reference "
          "is its own base, so it starts at log 2 = 0.693147): " + "; ".join(
              f"{k} " + "/".join(f"{r['losses'][0]:.6f}" for r in results[k]) for k in args.rows))
    for k in args.rows:
        for r in results[k]:
            if r["threads"] != args.threads:
                print(f"WARNING: {k} ran with {r['threads']} threads, not {args.threads}")
            if r["tokens"] != 2 * args.batch_size * args.seq_len:
                print(f"WARNING: {k} trained on {r['tokens']} tokens a step, not {2 * args.batch_size * args.seq_len}")
            if r["estimate_note"]:
                print(f"estimate for {k}: {r['estimate_note']}")

    def med(kind: str, key: str) -> float:
        """The median over the row's processes of each process's median step."""
        return statistics.median(statistics.median(r[key]) for r in results[kind])

    def worst(kind: str, key: str) -> float:
        return max(r[key] for r in results[kind])

    def above(kind: str) -> float:
        return worst(kind, "peak") - floors[_floor(kind)]

    base = BASELINE if BASELINE in results else args.rows[0]
    print("imports only (the floor under each row's peak RSS): " + ", ".join(
        f"{k.removeprefix('imports-')} {v / GIB:.2f} GiB" for k, v in floors.items()))
    print(f"\n| row | set-up s | s/step (wall) | s/step (CPU) | tokens/s (wall) | peak RSS GiB | peak RSS above "
          f"imports GiB | peak live tensors GiB | titanite estimate GiB | step vs {base} (CPU) | RSS above imports vs "
          f"{base} | live tensors vs {base} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k in args.rows:
        setup = statistics.median(r["setup"] for r in results[k])
        w, c = med(k, "wall"), med(k, "cpu")
        tps = statistics.median(r["tokens"] for r in results[k]) / w
        est = results[k][0]["estimate"]
        est_s = f"{est / GIB:.3f}" if est is not None and not results[k][0]["estimate_note"] else "-"
        print(f"| {ROWS[k]} | {setup:.1f} | {w:.2f} | {c:.2f} | {tps:,.0f} | {worst(k, 'peak') / GIB:.2f} | "
              f"{above(k) / GIB:.2f} | {worst(k, 'tensor_peak') / GIB:.3f} | {est_s} | {c / med(base, 'cpu'):.2f}x | "
              f"{above(k) / above(base):.2f}x | {worst(k, 'tensor_peak') / worst(base, 'tensor_peak'):.2f}x |")
    print("\npeak live tensors = alive at the step's start + the most the step adds (GiB, first process): " + "; ".join(
        f"{k} {results[k][0]['tensor_split'][0] / GIB:.3f} + {results[k][0]['tensor_split'][1] / GIB:.3f}"
        for k in args.rows))
    print("resident set after the timed steps, anonymous + file-backed (GiB, first process): " + "; ".join(
        f"{k} {results[k][0]['rss_parts'].get('RssAnon', 0) / GIB:.2f} + "
        f"{results[k][0]['rss_parts'].get('RssFile', 0) / GIB:.2f}" for k in args.rows))
    if args.repeats > 1:
        print("\nper process (wall s/step, median of its steps): " + "; ".join(
            f"{k} " + "/".join(f"{statistics.median(r['wall']):.2f}" for r in results[k]) for k in args.rows))
    print(f"\nwhole benchmark: {time.perf_counter() - began:.0f} s")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", choices=tuple(ROWS), default=list(DEFAULT_ROWS),
                   help=f"rows to run, in this order (default: {' '.join(DEFAULT_ROWS)}); ratios are against "
                        f"{BASELINE} when it runs, else the first row")
    p.add_argument("--quick", action="store_true", help="hidden 256, 4 layers, MLP 768, 1 + 2 steps")
    p.add_argument("--repeats", type=int, default=3, help="processes per row (the row order rotates each round)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per process")
    p.add_argument("--steps", type=int, default=5, help="timed steps per process (the median is reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads per process (default 1, as benchmarks/lora.py: steadier on a shared machine)")
    p.add_argument("--spec", default="qwen3", choices=("qwen3", "hf"), help="titanite's model.spec")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--intermediate", type=int, default=1152)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=384, help="the model's vocabulary rows (>= the tiny tokenizer's 384)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2, help="pairs per step (2 x this many sequences)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--loss", default="auto", choices=("auto", "reference", "chunked"),
                   help="titanite's kernels.loss in every titanite row (DPO's sequence log-probs go through it too)")
    p.add_argument("--child", choices=tuple(ROWS) + ("imports-titanite", "imports-trl"), help=argparse.SUPPRESS)
    for k in ("out", "policy", "reference", "tokenizer", "pairs", "chat"):
        p.add_argument(f"--{k}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        apply_quick(args, steps=2)
    print(machine())
    print(f"titanite: {titanite_state()}")
    sys.stdout.flush()
    measure(args)


if __name__ == "__main__":
    main()

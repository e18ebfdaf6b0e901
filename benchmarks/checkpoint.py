"""How long a checkpoint save blocks the training step, per checkpoint.async_mode, for a ~400M
Qwen3 on this CPU (fp32, one process).

The model is benchmarks/startup.py's: a transformers Qwen3 config (hidden 1024, 7 layers, MLP
3072, 16 / 8 heads of 64, untied 151,936-row vocabulary: 399.3M parameters), initialised at
random by titanite (`model.init = "random"`), the real Qwen3 tokenizer and a small text file.
One Trainer is built and trained for one step (so AdamW's state exists: a checkpoint holds the
weights and both moments, 4.47 GiB), then saved through `Trainer._save` in each mode, as the
loop saves:

- blocked: the time `_save` keeps the step (the finite check of every parameter and optimizer
  tensor, the temporary folder, and for "off" the whole save; for the async modes the copy into
  host memory);
- total: from the start of `_save` until the checkpoint is renamed into place (hashed, manifest
  written, pruned): `_save` plus `Saver.wait()`, with the training loop idle meanwhile;
- while training: the same save with training steps running until it lands: how many steps ran,
  their mean time against the mean of steps without a save, and the total save time then.

Each mode saves `--saves` times (the first async save allocates the host buffers, later ones
reuse them). Checkpoints go to a fresh folder under --root (keep_latest = 1).

    .venv/bin/python benchmarks/checkpoint.py               # the docs/performance.md table
    .venv/bin/python benchmarks/checkpoint.py --quick       # hidden 256, 2 layers
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import add_model_args, machine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GIB = 2**30


def build_trainer(root: Path, args: argparse.Namespace):
    import torch
    import transformers

    from titanite.core.config import load_config
    from titanite.run.trainer import Trainer

    folder = root / "model"
    transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=4096, tie_word_embeddings=False,
        torch_dtype="float32").save_pretrained(folder)  # config.json only: titanite initialises
    words = "the model is built on the meta device and then every rank holds all of it".split()
    data = root / "data.txt"
    data.write_text("".join(f"{i} " + " ".join(words[i % 7:] + words[:i % 7]) + ".\n" for i in range(2000)))
    overrides = {"job.output_dir": root / "run", "job.device": "cpu", "model.hf_path": folder,
                 "model.init": "random", "data.path": data, "data.tokenizer": "qwen3", "data.seq_len": 64,
                 "training.batch_size": 1, "training.steps": 10**6, "checkpoint.export_hf": "false",
                 "checkpoint.interval": 0, "checkpoint.keep_latest": 1, "metrics.peak_tflops": 1,
                 "metrics.progress_bar": "off"}
    trainer = Trainer(load_config(None, [f"--{k}={v}" for k, v in overrides.items()]))
    train_step_s(trainer)  # AdamW's state exists from here on
    n = sum(p.numel() for p in trainer.model.parameters())
    state = sum(t.numel() * t.element_size() for t in [*trainer.model.parameters(),
                *(v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v))])
    return trainer, n, state


def train_step_s(trainer) -> float:
    """One training step, in seconds (its numbers read, as a logging step does)."""
    start = time.perf_counter()
    trainer.train_step().read()
    trainer.step += 1
    return time.perf_counter() - start


def save_once(trainer, train_meanwhile: bool) -> dict:
    """One `_save` at the trainer's next step; returns blocked, total, and the steps that ran."""
    trainer.step += 1
    start = time.perf_counter()
    trainer._save()
    blocked = time.perf_counter() - start
    steps = []
    while train_meanwhile and trainer.saver.in_flight():
        steps.append(train_step_s(trainer))
    trainer.saver.wait()
    return {"blocked": blocked, "total": time.perf_counter() - start, "steps": steps}


def finite_check_s(trainer) -> float:
    start = time.perf_counter()
    trainer._stop_if_nonfinite(before_save=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="hidden 256, 2 layers, MLP 768")
    add_model_args(p)
    p.add_argument("--saves", type=int, default=2, help="saves per mode, idle (the first allocates the host copy)")
    p.add_argument("--modes", nargs="+", default=["off", "async", "async_pinned"])
    p.add_argument("--root", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads = 256, 2, 768, 4, 2
    logging.basicConfig(level=logging.WARNING)
    from titanite.checkpoint.saving import Saver

    root = Path(tempfile.mkdtemp(prefix="titanite-ckpt-bench-", dir=args.root))
    try:
        trainer, n, state = build_trainer(root, args)
        plain = [train_step_s(trainer) for _ in range(3)]
        print(machine())
        print(f"model: {n / 1e6:.1f}M parameters; checkpointed state {state / GIB:.2f} GiB (weights + AdamW "
              f"moments); a step without a save: {statistics.mean(plain):.2f} s; the finite check before each "
              f"save: {finite_check_s(trainer):.2f} s")
        rows, sync_blocked = [], None
        for mode in args.modes:
            trainer.saver.close()
            trainer.saver = Saver(mode, trainer.device, 600)
            idle = [save_once(trainer, train_meanwhile=False) for _ in range(args.saves)]
            busy = save_once(trainer, train_meanwhile=True)
            blocked = statistics.mean(r["blocked"] for r in idle[1:] or idle)
            if mode == "off":
                sync_blocked = blocked
            rows.append((mode, trainer.saver.mode, idle, blocked, busy))
        print("\n| async_mode | runs as | blocked, first save (s) | blocked, later saves (s) | blocked / sync | "
              "total, idle (s) | total, training meanwhile (s) | steps during it | their mean step (s) |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for mode, ran, idle, blocked, busy in rows:
            ratio = f"{blocked / sync_blocked:.1%}" if sync_blocked else "n/a"
            mean_step = f"{statistics.mean(busy['steps']):.2f}" if busy["steps"] else "-"
            print(f"| {mode} | {ran} | {idle[0]['blocked']:.2f} | {blocked:.2f} | {ratio} | "
                  f"{statistics.mean(r['total'] for r in idle):.2f} | {busy['total']:.2f} | {len(busy['steps'])} | "
                  f"{mean_step} |")
        trainer.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

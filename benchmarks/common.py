"""Pieces the benchmarks share (run them as scripts: `python benchmarks/<name>.py`)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def machine() -> str:
    """One line naming the CPU (lscpu's model name), cores, torch and transformers, and the date:
    figures are compared across sessions only on the same machine."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    import torch
    import transformers

    return (f"machine: {model}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {time.strftime('%Y-%m-%d')}")


def mark_phases(trainer_module, phase: list[str]) -> None:
    """Name the phase of each training step the sampler is in: forward (Trainer._forward),
    backward (until the gradient clipping), clip, optimizer (AdamW.step), weights check, save."""
    import torch

    Trainer = trainer_module.Trainer
    current = {"trainer": None}

    def enter(name: str, fn):
        def wrapped(*a, **kw):
            t = current["trainer"]
            phase[0] = f"step {t.step + 1} {name}" if t is not None and name != "save" else name
            return fn(*a, **kw)
        return wrapped

    forward = Trainer._forward

    def marked_forward(self, batch):
        current["trainer"] = self
        phase[0] = f"step {self.step + 1} forward"
        out = forward(self, batch)
        phase[0] = f"step {self.step + 1} backward"
        return out

    Trainer._forward = marked_forward
    trainer_module.clip_grad_norm_ = enter("clip", trainer_module.clip_grad_norm_)
    torch.optim.AdamW.step = enter("optimizer", torch.optim.AdamW.step)
    finite = trainer_module.FiniteWatch
    finite.note_weights = enter("weights check", finite.note_weights)
    Trainer._save = enter("save", Trainer._save)


def add_model_args(parser) -> None:
    """The benchmarks' Qwen3 shape flags; the defaults give the ~400M model (399.3M parameters
    untied) the start-up and checkpoint tables are measured on."""
    parser.add_argument("--vocab", type=int, default=151936, help="must exceed the Qwen3 tokenizer's largest id, 151,668")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=7, help="7: 399.3M parameters at the other defaults")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)


def time_steps(trainer, steps: int, warmup: int) -> tuple[list[float], list[float], list[float]]:
    """Drive `steps` optimizer steps of a Trainer by hand: (every step's loss, then the wall and
    CPU seconds of the steps after the first `warmup`). Each step ends with its host read."""
    losses, wall, cpu = [], [], []
    for i in range(steps):
        w, c = time.perf_counter(), time.process_time()
        values = trainer.train_step().read()  # the host read: the step is done
        w, c = time.perf_counter() - w, time.process_time() - c
        trainer.step += 1
        losses.append(values["loss"])
        if i >= warmup:
            wall.append(w)
            cpu.append(c)
    return losses, wall, cpu


def apply_quick(args, steps: int) -> None:
    """--quick: a smaller model (hidden 256, 4 layers) and one short repeat, for a smoke run."""
    args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 256, 768, 4, 4, 2
    args.repeats, args.warmup, args.steps = 1, 1, steps


def titanite_state() -> str:
    """The commit measured, and whether titanite/ had changes not yet committed."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "titanite"], capture_output=True, text=True,
                               cwd=REPO).stdout
    except OSError:
        return "unknown (no git)"
    changed = len(dirty.splitlines())
    return f"commit {head.strip()}" + (f" with {changed} uncommitted change(s) under titanite/" if changed else "")


def proc_status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out

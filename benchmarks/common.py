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


TINY_VOCAB_HELP = "the model's vocabulary rows (>= the tiny tokenizer's 384)"


def add_model_args(parser, vocab: int = 151936, hidden: int = 1024, intermediate: int = 3072, layers: int = 7,
                   heads: int = 16, kv_heads: int = 8, head_dim: int = 64,
                   vocab_help: str = "must exceed the Qwen3 tokenizer's largest id, 151,668") -> None:
    """The benchmarks' Qwen3 shape flags; the defaults give the ~400M model (399.3M parameters
    untied) the start-up and checkpoint tables are measured on."""
    parser.add_argument("--vocab", type=int, default=vocab, help=vocab_help)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--intermediate", type=int, default=intermediate)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--kv-heads", type=int, default=kv_heads)
    parser.add_argument("--head-dim", type=int, default=head_dim)


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


def tiny_inputs(root, args, env: dict, seq_len: int, tokens: int, words: str):
    """A random-init untied Qwen3 folder (config.json from args' shape flags: vocab, hidden,
    intermediate, layers, heads, kv_heads, head_dim; the tiny test tokenizer, trained quietly),
    a corpus of `tokens` words drawn from `words`, tokenized once into the shared store
    (XDG_CACHE_HOME: no run pays for, or races over, it). Returns (folder, corpus, parameters)."""
    import json
    import random
    import subprocess
    import sys

    sys.path.insert(0, str(REPO))
    import torch
    import transformers

    from tests.conftest import make_tiny_tokenizer

    torch.set_num_threads(os.cpu_count() or 1)  # tests.conftest sets the thread count: undo
    folder = root / "model"
    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=seq_len, tie_word_embeddings=False)
    cfg.save_pretrained(folder)  # random init reads only config.json
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the tokenizer trainer's progress lines (Rust, fd 1)
    try:
        make_tiny_tokenizer(folder)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.Qwen3ForCausalLM(cfg).parameters())
    vocabulary = words.split()
    rng = random.Random(0)
    data = root / "corpus.jsonl"
    with data.open("w") as f:
        for _ in range(tokens // 500 + 1):
            f.write(json.dumps({"text": " ".join(rng.choice(vocabulary) for _ in range(500))}) + "\n")
    subprocess.run([sys.executable, "-m", "titanite.cli", "data", "prepare", "--workers", "1",
                    f"--data.path={data}", f"--model.hf_path={folder}", "--data.packing=stream",
                    f"--data.seq_len={seq_len}"], check=True, env=env, cwd=REPO, capture_output=True)
    return folder, data, params


def machine_busy() -> float:
    """CPU seconds every process on the machine has spent so far (/proc/stat: all but idle and iowait)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    """CPU seconds of this process's finished children and their descendants (torchrun and its ranks)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def launch(ranks: int, child, record_env: str, train_argv: list[str], record, env: dict[str, str],
           timeout: float) -> dict:
    """One torchrun job of `ranks` ranks of the benchmark's `child` script (each writes its record
    under the folder that `record_env` names): its metrics rows and every rank's record, or the
    failure's causes and last lines. `others`: the CPU the rest of the machine used meanwhile
    (cores, on average over the job)."""
    import json
    import subprocess
    import sys
    import time

    record.mkdir(parents=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(child),
            "--rank"] + train_argv
    t0, busy0, own0 = time.perf_counter(), machine_busy(), own_cpu()
    try:
        proc = subprocess.run(argv, env={**env, record_env: str(record)}, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        return {"error": f"timed out after {timeout:.0f} s", "tail": tail.decode() if isinstance(tail, bytes) else tail}
    wall = time.perf_counter() - t0
    others = max(0.0, (machine_busy() - busy0) - (own_cpu() - own0)) / wall
    if proc.returncode != 0:
        # the ranks' own output, before torchrun's summary of the failure (which names no cause)
        cut = proc.stderr.rfind('Traceback (most recent call last):\n  File "<frozen runpy>"')
        ranks_err = proc.stderr[:cut] if cut > 0 else proc.stderr
        causes = list(dict.fromkeys(line.strip() for line in ranks_err.splitlines()
                                    if "Error" in line or "error:" in line or "Exception" in line))
        return {"error": f"exit {proc.returncode}: " + (causes[-1][:300] if causes else "no error line"),
                "tail": ranks_err[-4000:], "causes": causes[:8], "wall": wall, "others": others}
    out = Path(next(a.split("=", 1)[1] for a in train_argv if a.startswith("--job.output_dir=")))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [json.loads((record / f"rank-{r}.json").read_text()) for r in range(ranks)]
    return {"rows": [r for r in rows if "tokens_per_sec" in r], "ranks": records, "wall": wall, "others": others}


def print_header() -> None:
    """The machine, titanite's state, the command line and the load at the start, flushed."""
    import sys

    print(machine())
    print(f"titanite: {titanite_state()}")
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    print(f"load average at the start: {Path('/proc/loadavg').read_text().split()[0]}")
    sys.stdout.flush()


def run_env(root, **extra: str) -> dict[str, str]:
    """The environment of a benchmark's training jobs: their token store under `root`, offline,
    titanite importable from the checkout."""
    return {**os.environ, "XDG_CACHE_HOME": str(root / "cache"), "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1", **extra}


def child_baseline(root, env: dict[str, str], child, record_env: str) -> dict[str, int]:
    """What a rank process of `child` holds once titanite.run.trainer is imported (its --baseline)."""
    import json
    import sys

    record = root / "baseline"
    record.mkdir()
    subprocess.run([sys.executable, str(child), "--rank", "--baseline"], check=True, cwd=REPO,
                   env={**env, record_env: str(record)})
    return json.loads((record / "baseline.json").read_text())


def write_baseline(argv: list[str], record_env: str) -> bool:
    """In a benchmark's rank process: with --baseline, record this process's memory once
    titanite.run.trainer is imported and say so (True: the process has nothing more to do)."""
    import json

    import titanite.run.trainer  # noqa: F401

    if argv != ["--baseline"]:
        return False
    (Path(os.environ[record_env]) / "baseline.json").write_text(json.dumps(proc_status()))
    return True


def train_and_record(argv: list[str], marks: dict, record, me: int) -> None:
    """A benchmark rank's run of titanite.train: `marks` gets the memory when the first save
    begins (i.e. through the training steps) and at exit, and goes to record/rank-<me>.json;
    the process then exits with the run's code."""
    import json
    import time

    import torch

    import titanite.run.trainer
    from titanite.parallel.distributed import exit_process
    from titanite.train import main

    save = titanite.run.trainer.Trainer._save

    def marked_save(self, *a, **kw):
        marks.setdefault("before_save", {"t": time.time(), "step": self.step, **proc_status()})
        return save(self, *a, **kw)

    titanite.run.trainer.Trainer._save = marked_save
    code = main(argv)
    marks["exit"] = {"t": time.time(), **proc_status()}
    marks["threads"] = torch.get_num_threads()
    marks["rank"] = me
    (record / f"rank-{me}.json").write_text(json.dumps(marks))
    exit_process(code)

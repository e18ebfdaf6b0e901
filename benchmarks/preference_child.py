"""The child processes of benchmarks/preference.py: each row runs in its own process (so each has
its own peak RSS) and prints one JSON line of what it measured. titanite's rows drive a Trainer
by hand; TRL's run trl.DPOTrainer as tests/fixtures/preference.py sets it up to match titanite.
Also the probes both kinds use: VmHWM, the resident set's parts, and live tensors over a step."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

from common import time_steps

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30



# -- measuring inside a child -------------------------------------------------------------------


def vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_parts() -> dict[str, int]:
    """The resident set now, by kind: anonymous (heap, tensors) and file-backed (mapped files, such
    as safetensors weights still mapped), in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage Python holds now (each storage once)."""
    import torch

    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not o.is_meta:
                    s = o.untyped_storage()
                    if s.data_ptr():
                        seen[s.data_ptr()] = s.nbytes()
            except Exception:  # noqa: BLE001 - odd objects (sparse, fake) are not the step's memory
                continue
    return sum(seen.values())


class StepPeak:
    """The peak of live tensors over one step: what is alive at its start, plus the highest total
    the profiler's allocation events reach during it (relative to its start)."""

    def __init__(self, trace: Path) -> None:
        self.trace, self.prof, self.before = trace, None, 0

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.before = live_tensor_bytes()
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()

    def stop(self) -> int:
        self.prof.__exit__(None, None, None)
        self.prof.export_chrome_trace(str(self.trace))
        events = json.loads(self.trace.read_text())["traceEvents"]
        during = max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=0)
        self.trace.unlink()
        self.during = during
        return self.before + during


def titanite_child(args: argparse.Namespace) -> dict:
    import torch

    from titanite.core.config import load_config
    from titanite.run.trainer import Trainer

    logging.getLogger("titanite").setLevel(logging.WARNING)
    steps = args.warmup + args.steps
    overrides = {
        "job.output_dir": args.out, "job.device": "cpu", "model.spec": args.spec, "model.hf_path": args.policy,
        "data.seq_len": args.seq_len, "training.steps": steps + 1, "training.lr": args.lr,
        "training.lr_schedule": "constant", "training.weight_decay": 0.0, "training.beta1": 0.9,
        "training.beta2": 0.999, "training.max_grad_norm": 1.0, "training.mixed_precision": "none",
        "metrics.peak_tflops": 1.0, "metrics.progress_bar": "off", "checkpoint.export_hf": "false",
        "kernels.loss": args.loss,
    }
    if args.child == "sft":
        overrides.update({"training.objective": "lm", "data.format": "chat", "data.path": args.chat,
                          "data.packing": "pad", "training.batch_size": 2 * args.batch_size})
    else:
        overrides.update({"training.objective": "dpo", "data.format": "preference", "data.path": args.pairs,
                          "training.batch_size": args.batch_size, "preference.beta": 0.1})
        if args.child == "dpo-lora":
            overrides.update({"lora.enabled": "true", "lora.rank": args.rank, "lora.alpha": args.alpha})
        else:
            overrides.update({"preference.reference": args.child.removeprefix("dpo-"),
                              "preference.reference_path": args.reference})
    cfg = load_config(None, [f"--{k}={v}" for k, v in overrides.items()])
    start = time.perf_counter()
    trainer = Trainer(cfg)
    setup = time.perf_counter() - start
    losses, wall, cpu = time_steps(trainer, steps, args.warmup)
    peak = vm_hwm_bytes()  # before the profiled step, whose trace takes memory of its own
    parts = rss_parts()
    probe = StepPeak(Path(args.out) / "trace.json")
    probe.start()
    trainer.train_step().read()
    tensor_peak = probe.stop()
    trainer.step += 1
    trainer.close()
    est, est_note = None, ""
    try:
        from titanite.plan import estimate

        e = estimate(cfg, 1)
        est = e.total
        if cfg.training.objective == "dpo" and getattr(e, "preference", None) is None:
            est_note = "no DPO share"
    except Exception as exc:  # noqa: BLE001 - an estimate that cannot count this config is reported, not fatal
        est_note = f"failed: {type(exc).__name__}: {exc}"[:200]
    return {"setup": setup, "losses": losses, "wall": wall, "cpu": cpu, "peak": peak, "tensor_peak": tensor_peak,
            "tensor_split": [probe.before, probe.during], "rss_parts": parts, "estimate": est,
            "estimate_note": est_note, "tokens": 2 * args.batch_size * args.seq_len, "threads": torch.get_num_threads()}


def trl_child(args: argparse.Namespace) -> dict:
    import torch
    from transformers import TrainerCallback

    sys.path.insert(0, str(REPO))
    from titanite.device.memory import set_host_memory_policy

    set_host_memory_policy(1)  # as titanite's single process does (see the module docstring)
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from tests.fixtures.preference import load_tokenizer, transformers_causal_lm

    torch.set_num_threads(args.threads)
    steps = args.warmup + args.steps
    rows = [json.loads(line) for line in Path(args.pairs).read_text().splitlines()]
    precompute = args.child == "trl-precomputed"
    config = DPOConfig(
        output_dir=args.out, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
        max_steps=steps + 1, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch_fused", bf16=False,
        fp16=False, use_cpu=True, activation_checkpointing=False, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, data_seed=0, disable_dropout=True, max_length=args.seq_len,
        dataloader_drop_last=False, dataloader_num_workers=0, remove_unused_columns=False, beta=0.1,
        loss_type=["sigmoid"], precompute_ref_log_probs=precompute, truncation_mode="keep_start",
        pad_to_multiple_of=None)
    seen: list[tuple[int, int]] = []  # per batch: (ids' elements, attended tokens)
    trace = Path(args.out) / "trace.json"

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = [time.perf_counter()]
            self.cpu: list[float] = [time.process_time()]
            self.losses: list[float] = []
            self.threads = 0
            self.probe = StepPeak(trace)
            self.tensor_peak = self.peak = 0
            self.parts: dict[str, int] = {}

        def on_train_begin(self, *a, **kw):
            torch.set_num_threads(args.threads)
            self.ends, self.cpu = [time.perf_counter()], [time.process_time()]

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == steps:  # the extra, profiled step
                self.probe.start()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step == steps + 1:
                self.tensor_peak = self.probe.stop()
                return
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())
            self.threads = torch.get_num_threads()
            if state.global_step == steps:
                self.peak, self.parts = vm_hwm_bytes(), rss_parts()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs and len(self.losses) < steps:
                self.losses.append(float(logs["loss"]))

    timer = Timer()
    kw = {}
    ref = None
    start = time.perf_counter()
    if args.child == "trl-lora":
        from peft import LoraConfig

        kw["peft_config"] = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                                       target_modules="all-linear", task_type="CAUSAL_LM")
    elif not precompute:
        ref = transformers_causal_lm(Path(args.reference))
    policy = transformers_causal_lm(Path(args.policy))
    if precompute:  # TRL's precompute pass runs the reference given as ref_model, then drops it
        ref = transformers_causal_lm(Path(args.reference))
    trainer = DPOTrainer(model=policy, ref_model=ref, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=load_tokenizer(Path(args.tokenizer)), callbacks=[timer], **kw)
    if precompute:
        trainer.ref_model = ref = None  # the log-probs are in the dataset now
        gc.collect()
    collate = trainer.data_collator

    def counting(examples):
        batch = collate(examples)
        seen.append((batch["input_ids"].numel(), int(batch["attention_mask"].sum())))
        return batch

    trainer.data_collator = counting
    setup = time.perf_counter() - start
    trainer.train()
    wall = [b - a for a, b in zip(timer.ends, timer.ends[1:])][args.warmup:]
    cpu = [b - a for a, b in zip(timer.cpu, timer.cpu[1:])][args.warmup:]
    tokens = [t for _, t in seen[:steps]]
    return {"setup": setup, "losses": timer.losses, "wall": wall, "cpu": cpu, "peak": timer.peak,
            "tensor_peak": timer.tensor_peak, "tensor_split": [timer.probe.before, timer.probe.during],
            "rss_parts": timer.parts, "estimate": None, "estimate_note": "",
            "tokens": statistics.median(tokens), "padded": statistics.median(n for n, _ in seen[:steps]),
            "threads": timer.threads}


def imports_child(args: argparse.Namespace) -> dict:
    """A process that imports what a row's process imports, and stops: its peak RSS is the floor
    under that row's."""
    import torch  # noqa: F401

    if args.child == "imports-trl":
        sys.path.insert(0, str(REPO))
        import datasets  # noqa: F401
        import peft  # noqa: F401
        from trl import DPOConfig, DPOTrainer  # noqa: F401

        import tests.fixtures.preference  # noqa: F401
        from titanite.device.memory import set_host_memory_policy  # noqa: F401
    else:
        import titanite.core.config  # noqa: F401
        import titanite.plan  # noqa: F401
        import titanite.run.trainer  # noqa: F401
    return {"peak": vm_hwm_bytes()}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the result line
        if args.child.startswith("imports"):
            result = imports_child(args)
        else:
            result = trl_child(args) if args.child.startswith("trl") else titanite_child(args)
    print(json.dumps(result))

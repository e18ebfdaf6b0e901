"""`titanite eval`: lm-evaluation-harness benchmark scores of a model folder.

The folder is read as `titanite generate` reads it (a Hugging Face folder, a training
checkpoint, a run's output_dir, or a LoRA adapter folder on its base), loaded on one device
with the native model. Loglikelihood tasks (multiple choice, perplexity) score with its forward;
generation tasks decode with `titanite generate`'s KV cache, stopping at the task's stop
sequences. lm-eval's tasks and metrics do the rest (titanite/evaluation/harness.py).

`TitaniteFolderLM` is registered with lm-eval as model "titanite", so that once this module is
imported, `lm_eval.simple_evaluate(model="titanite", model_args="pretrained=DIR")` works too.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from titanite.commands.base import setup_logging
from titanite.commands.generate import Sampling, generate, load_generator
from titanite.core.errors import UserError
from titanite.device.choice import default_compute_dtype, pick_device
from titanite.evaluation.heldout import require_lm_eval

require_lm_eval("titanite eval")  # one clear message when lm-eval is missing, before anything imports it

from lm_eval.api.registry import register_model  # noqa: E402

from titanite.evaluation.harness import Decoding, TitaniteLM, evaluate, load_tasks, scores  # noqa: E402

log = logging.getLogger("titanite")


@register_model("titanite")
class TitaniteFolderLM(TitaniteLM):
    """lm-eval's model for a folder `titanite generate` can read (`pretrained`), on `device`
    ("auto": the accelerator, else the CPU) in `dtype` ("auto": bfloat16 on accelerators,
    float32 on the CPU)."""

    def __init__(self, pretrained: str, batch_size: int | str = 8, device: str | None = "auto",
                 dtype: str = "auto", base: str | None = None, trust_remote_code: bool = False,
                 **_: Any) -> None:
        if str(batch_size).startswith("auto"):
            raise UserError("batch_size 'auto' is not supported: give a number of requests per forward")
        where = pick_device(device or "auto", "--device")
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if dtype not in (*dtypes, "auto"):
            raise UserError(f"--dtype must be auto, float32 or bfloat16, got {dtype!r}")
        generator = load_generator(pretrained, dtype=dtypes.get(dtype, default_compute_dtype(where)),
                                   device=where, trust_remote_code=trust_remote_code, base=base)
        model = generator.model

        def decode(prompt: list[int], how: Decoding, done: Callable[[list[int]], bool]) -> list[int]:
            sampling = Sampling(how.max_new_tokens, how.temperature, how.top_p)
            sampling.check()
            return generate(model, prompt, sampling, generator.stop_ids, done)

        super().__init__(model, generator.tokenizer_json.parent, model.args.max_position_embeddings,
                         int(batch_size), decode, where)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titanite eval",
        description="Score a model on lm-evaluation-harness tasks with lm-eval's own task definitions and "
                    "metrics, titanite's model doing the forward. Local task YAMLs (--include-path) with "
                    "local data files need no network; lm-eval's own tasks fetch their data sets from the "
                    "Hugging Face Hub, as lm-eval does.")
    parser.add_argument("--model", required=True,
                        help="HF folder, checkpoint folder, run output_dir, or a LoRA adapter folder")
    parser.add_argument("--tasks", required=True, help="task or group names, comma-separated")
    parser.add_argument("--include-path", default="", help="a folder of local task YAMLs")
    parser.add_argument("--limit", type=int, default=0, help="score at most N documents per task (0 = all)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward (default 8)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="auto = bfloat16 on accelerators, float32 on CPU")
    parser.add_argument("--base", help="for a LoRA adapter: the base model folder (default: the one "
                                       "adapter_config.json records)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let code shipped in a checkpoint's model.hf_path run (hf spec); off by default")
    parser.add_argument("--output", help="also write the scores and lm-eval's results here, as JSON")
    args = parser.parse_args(argv)
    setup_logging()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks names no task")
    if args.limit < 0 or args.batch_size < 1:
        raise UserError(f"--limit must be >= 0 and --batch-size >= 1, got {args.limit} and {args.batch_size}")
    if args.include_path and not Path(args.include_path).expanduser().is_dir():
        raise UserError(f"--include-path: {args.include_path} is not a folder")
    load_tasks(tasks, args.include_path)  # every name, data file and setting, before the model loads
    lm = TitaniteFolderLM(args.model, args.batch_size, args.device, args.dtype, args.base, args.trust_remote_code)
    results = evaluate(lm, tasks, args.include_path, args.limit)
    found = scores(results)
    print(table(found), flush=True)
    if args.output:
        keep = ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples")
        report = {"scores": found, **{k: results[k] for k in keep if k in results}}
        Path(args.output).write_text(json.dumps(report, indent=2, default=str) + "\n")
        log.info("wrote %s", args.output)
    return 0


def table(found: dict[str, float]) -> str:
    """One line per task and metric: value, and ± its standard error where lm-eval gave one."""
    lines = []
    for name, value in found.items():
        _, task, metric = name.split("/", 2)
        if "_stderr" in metric.split("/")[0]:
            continue
        head, _, kept = metric.partition("/")
        stderr = found.get(f"eval/{task}/{head}_stderr" + (f"/{kept}" if kept else ""))
        error = f" ± {stderr:.4f}" if stderr is not None and math.isfinite(stderr) else ""
        lines.append(f"{task:<28} {metric:<24} {value:.4f}{error}")
    return "\n".join(lines)

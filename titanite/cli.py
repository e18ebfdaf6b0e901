"""The `titanite` command: train | export | (more subcommands register here)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from titanite.errors import EXIT_DIVERGED, EXIT_USER_ERROR, TrainingDiverged, UserError
from titanite.files import STORAGE_ERRNOS, storage_error

log = logging.getLogger("titanite")


def setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 or os.environ.get("TITANITE_LOG_ALL_RANKS") else logging.WARNING
    prefix = f"[titanite r{rank}]" if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1" else "[titanite]"
    logging.basicConfig(level=level, format=f"{prefix} %(message)s", stream=sys.stderr, force=True)


def _user_errors(fn):
    """Run fn; a UserError or a storage fault (full disk, read-only folder) becomes one message
    and exit 2, divergence exit 3."""
    def wrapped(*a, **kw) -> int:
        try:
            return fn(*a, **kw) or 0
        except UserError as e:
            print(f"titanite: error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
        except OSError as e:
            if e.errno not in STORAGE_ERRNOS:
                raise
            print(f"titanite: error: {storage_error(e, 'writing the run')}", file=sys.stderr)
            return EXIT_USER_ERROR
        except TrainingDiverged as e:
            print(f"titanite: training diverged: {e}", file=sys.stderr)
            return EXIT_DIVERGED
    return wrapped


@_user_errors
def run_train(argv: list[str]) -> int:
    from titanite.config import help_text, load_config

    parser = argparse.ArgumentParser(prog="titanite train", description="Train a Qwen3 model.",
                                     epilog="Overrides: --section.key=value (see --help-config).")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--help-config", action="store_true", help="list every config key and exit")
    args, overrides = parser.parse_known_args(argv)
    if args.help_config:
        print(help_text())
        return 0
    setup_logging()
    cfg = load_config(args.config, overrides)
    from titanite.trainer import Trainer

    Trainer(cfg).train()
    return 0


@_user_errors
def run_export(argv: list[str]) -> int:
    from titanite.config import DEFAULT_SHARD_MB

    parser = argparse.ArgumentParser(prog="titanite export",
                                     description="Turn a training checkpoint into a Hugging Face folder "
                                                 "(for a LoRA run: its adapter in peft's format, or with "
                                                 "--merged the base with the adapters merged in).")
    parser.add_argument("--checkpoint", required=True, help="a checkpoints/step-N folder")
    parser.add_argument("--out", required=True, help="output folder (replaced atomically)")
    parser.add_argument("--shard-mb", type=int, default=DEFAULT_SHARD_MB, help="largest safetensors shard, MB")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let code shipped in the run's model.hf_path run (hf spec); off by default, "
                             "whatever the checkpoint's config.toml says")
    parser.add_argument("--merged", action="store_true",
                        help="LoRA runs: write the base with the adapters merged in (loads without peft)")
    args = parser.parse_args(argv)
    setup_logging()
    from titanite.export import export_checkpoint

    export_checkpoint(Path(args.checkpoint), Path(args.out), args.shard_mb, args.trust_remote_code,
                      merged=args.merged)
    return 0


@_user_errors
def run_checkpoint(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titanite checkpoint",
        description="verify DIR: check a training checkpoint (checkpoints/step-N), or every checkpoint of a "
                    "run folder or checkpoints/ folder, against its manifest (sizes and SHA-256), and read "
                    "its DCP metadata safely. Exit 0 when all are intact, 2 otherwise.")
    parser.add_argument("action", choices=("verify",))
    parser.add_argument("dir", help="checkpoints/step-N, checkpoints/, or a run's output_dir")
    args = parser.parse_args(argv)
    setup_logging()
    from titanite.checkpoint.training_state import verify_command

    return verify_command(Path(args.dir))


@_user_errors
def run_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titanite generate",
        description="Generate text with a KV cache from a Hugging Face folder, a training checkpoint "
                    "(checkpoints/step-N) or a run folder (its latest checkpoint). Chat models get "
                    "their prompt rendered with the tokenizer's chat template.")
    parser.add_argument("--model", required=True,
                        help="HF folder, checkpoint folder, run output_dir, or a LoRA adapter folder")
    parser.add_argument("--base", help="for a LoRA adapter: the base model folder (default: the one "
                                       "adapter_config.json records)")
    parser.add_argument("--prompt", required=True, action="append",
                        help="prompt text (repeat for several; each is answered on its own)")
    parser.add_argument("--system", default="", help="system message for chat models")
    parser.add_argument("--raw", action="store_true", help="use the prompt as plain text, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="auto = bfloat16 on accelerators, float32 on CPU")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let code shipped in a checkpoint's model.hf_path run (hf spec); off by default")
    args = parser.parse_args(argv)
    setup_logging()
    import torch

    from titanite.device import default_compute_dtype, pick_device
    from titanite.generate import Sampling, load_generator

    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    sampling.check()
    device = pick_device(args.device, "--device")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, default_compute_dtype(device))
    generator = load_generator(args.model, dtype=dtype, device=device, trust_remote_code=args.trust_remote_code,
                               base=args.base)
    for prompt in args.prompt:
        print(generator.complete(prompt, sampling, system=args.system, raw=args.raw), flush=True)
    return 0


@_user_errors
def run_eval(argv: list[str]) -> int:
    setup_logging()
    from titanite.eval import require_lm_eval

    require_lm_eval("titanite eval")
    from titanite.eval_command import main as eval_main

    return eval_main(argv)


@_user_errors
def run_kernels(argv: list[str]) -> int:
    setup_logging()
    from titanite.kernels.cli import main as kernels_main
    from titanite.models.call_sites import verify_call_sites

    return kernels_main(argv, call_sites=verify_call_sites)


@_user_errors
def run_device(argv: list[str]) -> int:
    setup_logging()
    from titanite.device_check import main as device_main

    return device_main(argv)


@_user_errors
def run_plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titanite plot",
                                     description="Draw loss, learning rate and tokens/s of one or more runs "
                                                 "(their metrics.jsonl) on shared axes.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (job.output_dir)")
    parser.add_argument("-o", "--out", default="curves.png", help="image to write (default curves.png)")
    args = parser.parse_args(argv)
    setup_logging()
    from titanite.plot import plot_runs

    plot_runs(args.runs, args.out)
    log.info("wrote %s", args.out)
    return 0


@_user_errors
def run_data(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titanite data",
        description="prepare: tokenize a config's [data] (and eval.path) once into token stores, in "
                    "parallel; training memory-maps them. By default they go to data.cache_dir, where "
                    "every later run of the same source and tokenizer finds them; with --out, to that "
                    "folder (point data.path at it). verify DIR: re-hash a store's files against its "
                    "manifest. Exit 0 when done / intact, 2 otherwise.",
        epilog="Overrides: --section.key=value, as for titanite train.")
    parser.add_argument("action", choices=("prepare", "verify"))
    parser.add_argument("dir", nargs="?", help="verify: the store folder")
    parser.add_argument("--config", help="prepare: the TOML config whose [data] to tokenize")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) // 2),
                        help="prepare: tokenizer processes (default: half the CPUs)")
    parser.add_argument("--out", help="prepare: write the [data] store to this folder instead of the cache")
    args, overrides = parser.parse_known_args(argv)
    setup_logging()
    from titanite.data import prepare, store

    if args.action == "verify":
        if not args.dir:
            raise UserError("titanite data verify needs the store folder: titanite data verify DIR")
        store.verify_store(Path(args.dir))
        print(f"{args.dir}: intact")
        return 0
    if overrides and not all(o.startswith("--") for o in overrides):
        raise UserError(f"titanite data prepare: unexpected arguments {overrides}")
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    from titanite.config import load_config
    from titanite.data.tokenizer import load_tokenizer
    from titanite.preflight import check_input_paths

    cfg = load_config(args.config, overrides)
    check_input_paths(cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    from titanite.data.mixture import run_data_configs

    if cfg.data.sources and args.out:
        raise UserError("--out names one store, but data.sources is a mixture: prepare into data.cache_dir "
                        "(leave out --out), where training finds every source's store")
    for what, data in run_data_configs(cfg):
        out = Path(args.out) if args.out and what == "data.path" else None
        if out:
            with prepare.locked_destination(out):
                made = prepare.prepare(data, tokenizer, out, args.workers)
        else:
            made = prepare.obtain(data, tokenizer, args.workers)
        print(f"{what}: {made.path} ({made.num_samples} samples, {made.num_tokens} tokens, largest id {made.max_id})")
    return 0


@_user_errors
def run_estimate(argv: list[str]) -> int:
    from titanite.plan import main as estimate_main

    return estimate_main(argv)


COMMANDS = {"train": run_train, "export": run_export, "checkpoint": run_checkpoint, "generate": run_generate, "eval": run_eval, "kernels": run_kernels,
            "plot": run_plot, "estimate": run_estimate, "data": run_data, "device": run_device}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: titanite {{{'|'.join(COMMANDS)}}} ...", file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"titanite: error: unknown command '{argv[0]}'", file=sys.stderr)
            return EXIT_USER_ERROR
        return 0
    return COMMANDS[argv[0]](argv[1:])


def entry() -> None:
    """The `titanite` console script and `python -m titanite.cli`."""
    from titanite.parallel.distributed import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()

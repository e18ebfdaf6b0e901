"""Preflight: everything that can be checked before any work, checked once, in one place.

`preflight(cfg)` runs before the process group starts, before any file is written and before
any data is tokenized. It reads only small things: config.json, safetensors headers, the
tokenizer, file types. A failure is a UserError (exit 2) naming the key, the value and the
rule, and leaves the output folder as it was. What it checks:

- no live run holds the output folder, and it can be written (not a file, not read-only);
- every input path exists and is a regular file or folder (never a FIFO, socket or device);
- the parallel degrees against the world size, then against the architecture;
- the architecture itself (config.json values, see models/qwen3/args.py) and that the RoPE
  settings reach `data.seq_len` (max_position_embeddings, or what the RoPE scaling extends it to);
- kernel selections against the device and compute dtype;
- the published weights when they will be loaded: safetensors only (a folder with only
  pickle weights is refused with how to convert), names, shapes, dtypes and sizes from the
  headers;
- the tokenizer against the vocabulary: its largest id, added and special tokens included,
  must be below the model's vocab_size; so must a token store's named by data.path or
  eval.path, and otherwise the store cache (data.cache_dir) must be writable;
- eval.tasks: lm-eval installed, every task known and loadable with its data (titanite/evaluation/harness.py);
- the batch layout (global batch a multiple of per-rank batch x data-parallel ranks) and that
  the model supports the packing asked for;
- that the package of every tracker in metrics.trackers can be imported.

It returns what it built (the meta-device model with kernels attached, the tokenizer), so
the trainer does none of it twice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from titanite import kernels
from titanite.checkpoint.training_state import list_checkpoints
from titanite.core.config import Config, KernelsConfig, ModelConfig
from titanite.core.errors import UserError
from titanite.core.files import check_writable_folder, require_regular
from titanite.data import store as token_store
from titanite.data.mixture import run_data_configs
from titanite.data.packing import packing_mode
from titanite.data.sources import STDLIB
from titanite.data.tokenizer import Tokenizer, load_tokenizer
from titanite.device.choice import pick_device
from titanite.device.memory import total_memory
from titanite.models import lora
from titanite.models.handle import ModelHandle
from titanite.models.qwen3.args import Qwen3Args, rope_reach, to_hf_config
from titanite.models.spec import get_spec
from titanite.parallel import pipeline_layout
from titanite.parallel.mesh import ParallelDims
from titanite.parallel.pipeline_layout import PipelineLayout
from titanite.run import trackers
from titanite.run.preference.reference import check_reference, reference_model_config
from titanite.run.runlock import check_free

log = logging.getLogger("titanite")

# Weight files titanite never loads (unpickling runs code), by pattern.
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


@dataclass
class Prepared:
    """What preflight checked and built, for the trainer to use."""

    cfg: Config
    device: torch.device
    compute_dtype: torch.dtype
    dims: ParallelDims
    handle: ModelHandle  # the model on the meta device, kernels attached
    tokenizer: Tokenizer
    weights: str | None  # the HF folder to load when not resuming; None = random init
    grad_accum: int
    reference: ModelHandle | None = None  # preference training's separate reference model (meta)
    reference_weights: str | None = None  # the folder it loads; None = the seeded init
    pipeline: PipelineLayout | None = None  # parallelism.pp > 1: the stages and their schedule


def preflight(cfg: Config, world_size: int | None = None) -> Prepared:
    """Check everything that can be checked without doing work; see the module docstring."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    check_free(cfg.job.output_dir)  # a live run there: stop before doing anything
    check_writable_folder(cfg.job.output_dir, "job.output_dir")
    check_input_paths(cfg)
    trackers.check_installed(cfg.metrics)
    device = pick_device(cfg.job.device)
    dims = ParallelDims.resolve(cfg.parallelism, world_size)
    grad_accum = _grad_accum_steps(cfg, dims.dp)
    kernels.load_plugins(cfg.kernels.plugins)
    handle = get_spec(cfg.model.spec).build(cfg.model)
    if cfg.lora.enabled:  # before the kernels attach: the adapters replace modules they bind
        handle.apply_lora(cfg.lora)
    check_rope_reach(handle.args, cfg.data.seq_len)
    compute_dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    kernels_cfg = choose_loss(cfg, handle, device)
    handle.attach_kernels(kernels_cfg, device.type, compute_dtype)
    check_layout(dims, handle)
    check_balance_scope(cfg, handle.args)
    pipeline = pipeline_layout.check(cfg, dims, handle, grad_accum)
    # A run that will resume reads its weights from the checkpoint, not from model.hf_path; a
    # LoRA run's checkpoints hold only the adapters, so its base is always read.
    resuming = cfg.checkpoint.resume and bool(list_checkpoints(Path(cfg.job.output_dir) / "checkpoints"))
    weights = None if resuming and handle.lora is None else weights_to_load(cfg.model)
    if weights is not None:
        handle.check_hf(weights)
    if handle.lora is not None:
        check_lora(cfg, handle, weights, resuming)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    check_vocab(tokenizer, handle.args.vocab_size)  # a multimodal config.json keeps it in text_config
    check_data_stores(cfg, tokenizer, handle.args.vocab_size)
    reference, reference_weights = None, None
    if reference_model_config(cfg) is not None:  # preference training with a separate reference model
        reference, reference_weights = check_reference(cfg, handle, kernels_cfg, device.type, compute_dtype,
                                                       tokenizer, weights_to_load(cfg.model))
    if cfg.eval.tasks:
        check_eval_tasks(cfg)
    if packing_mode(cfg.data) == "documents" and not handle.supports_document_masks:
        raise UserError(f"data.packing = 'documents' needs attention that stays inside each packed "
                        f"sample, which model.spec = '{cfg.model.spec}' does not provide; set "
                        "data.packing = 'pad' (one sample per sequence)")
    return Prepared(cfg, device, compute_dtype, dims, handle, tokenizer, weights, grad_accum, reference,
                    reference_weights, pipeline)


def check_rope_reach(args: Qwen3Args, seq_len: int) -> None:
    """data.seq_len within what the RoPE settings reach (rope_reach); else the model.rope_scaling
    that reaches it: YaRN over the model's original length."""
    if seq_len <= rope_reach(args):
        return
    s = args.rope_scaling
    original = s.original_max_position_embeddings if s and s.rope_type == "yarn" else args.max_position_embeddings
    factor = math.ceil(seq_len / original * 100) / 100
    fix = (f"set model.rope_scaling = {{rope_type = 'yarn', factor = {factor}, "
           f"original_max_position_embeddings = {original}}}")
    if s is None:
        raise UserError(f"config key 'data.seq_len' ({seq_len}) exceeds the model's max_position_embeddings "
                        f"({args.max_position_embeddings}); lower data.seq_len, or extend the context with YaRN: {fix}")
    raise UserError(f"config key 'data.seq_len' ({seq_len}) exceeds the {rope_reach(args)} positions the model's "
                    f"RoPE scaling reaches ({s.rope_type}, factor {s.factor}); lower data.seq_len, or {fix}")


# `loss = "auto"` chooses the chunked loss when one micro-batch's fp32 logits would take more than
# this share of the device's memory (host RAM on CPU), the plain fused cross-entropy otherwise.
AUTO_LOSS_MEMORY_FRACTION = 0.10


def choose_loss(cfg: Config, handle: ModelHandle, device: torch.device, quiet: bool = False,
                memory: float | None = None) -> KernelsConfig:
    """`[kernels]` with `loss = "auto"` (the default) resolved by memory, and the choice logged
    with the numbers behind it. The chunked loss never holds the [tokens, V] logits but computes
    the head matmul again in backward (about 10% slower where memory is not short); an explicit
    `loss = "chunked"` or `"reference"` is kept as it is. `memory`: bytes of the device to decide
    for (the planner's named accelerator), default `device`'s."""
    select = cfg.kernels.select
    if select.get("loss", "auto") != "auto":
        return cfg.kernels
    rows = cfg.training.batch_size * (2 if cfg.training.objective == "dpo" else 1)  # a pair is two rows
    tokens = cfg.data.seq_len // cfg.parallelism.cp  # of each row, on this rank (context parallelism splits it)
    logits = rows * tokens * handle.args.vocab_size * 4  # fp32 bytes
    memory = memory or total_memory(device)
    pick = "chunked" if logits > AUTO_LOSS_MEMORY_FRACTION * memory else "reference"
    if not quiet:
        log.info("kernel loss: auto -> %s (one micro-batch's logits, %d x %d tokens x %d vocab in fp32, take "
                 "%.2f GiB = %.1f%% of the device's %.1f GiB; chunked above %d%%)", pick, rows,
                 tokens, handle.args.vocab_size, logits / 2**30, 100 * logits / memory, memory / 2**30,
                 round(100 * AUTO_LOSS_MEMORY_FRACTION))
    return dataclasses.replace(cfg.kernels, select={**select, "loss": pick})


def check_layout(dims: ParallelDims, handle: ModelHandle) -> None:
    """The parallel degrees against the architecture and what the backend can shard."""
    # titanite's reading of the architecture, in config.json's standard names: a checkpoint's
    # own file may spell them otherwise (transformers 5 writes num_local_experts).
    dims.check_model(to_hf_config(handle.args))
    scaling = getattr(handle.args, "rope_scaling", None)
    if dims.cp > 1 and scaling is not None and scaling.rope_type == "dynamic":
        raise UserError(f"parallelism.cp = {dims.cp} with the model's 'dynamic' RoPE scaling: dynamic scaling depends "
                        "on the longest position of each sequence, which no cp rank sees whole; use rope_type "
                        "'yarn' or 'linear' (model.rope_scaling) or set parallelism.cp = 1")
    if handle.args.is_hybrid and dims.cp > 1:
        raise UserError(f"config key 'parallelism.cp' = {dims.cp} is not available for this model yet: its Gated "
                        "DeltaNet layers carry a recurrent state along the sequence, which context parallelism does "
                        "not pass between ranks yet; set parallelism.cp = 1")
    if handle.args.is_hybrid and dims.pp > 1:
        raise UserError(f"config key 'parallelism.pp' = {dims.pp} is not available for this model yet: pipeline "
                        "stages are not cut over hybrid Gated DeltaNet / attention stacks yet; set parallelism.pp = 1")
    if handle.args.is_hybrid and dims.tp > 1 and handle.lora is not None:
        raise UserError(f"config key 'parallelism.tp' = {dims.tp} with [lora] is not available for "
                        f"{handle.args.model_type} yet: its Gated DeltaNet projections are cut by head blocks "
                        "(titanite/parallel/hybrid_tp.py), which the LoRA adapters are not; set parallelism.tp = 1")
    if dims.ep > 1 and not handle.supports_expert_parallel:
        raise UserError(f"config key 'parallelism.ep' = {dims.ep} is not available with model.spec = "
                        f"'{handle.backend}' (it cannot shard its experts yet); use model.spec = 'qwen3' or set "
                        "parallelism.ep = 1")


def check_balance_scope(cfg: Config, args: Qwen3Args) -> None:
    """model.aux_loss_scope against the model (a dense one has no such loss) and the objective."""
    scope = cfg.model.aux_loss_scope
    if not getattr(args, "num_experts", 0):
        if scope != "micro_batch":
            log.warning("model.aux_loss_scope = %r has no effect: the model is dense (no load-balancing loss)", scope)
        return
    if scope == "global_batch" and not args.output_router_logits:
        raise UserError("model.aux_loss_scope = 'global_batch', but the model's config.json has output_router_logits "
                        "= false, so the load-balancing loss is not trained (only logged); set output_router_logits "
                        "to true in config.json to train it, or leave aux_loss_scope at 'micro_batch'")
    if scope == "global_batch" and cfg.training.objective == "dpo":
        raise UserError("model.aux_loss_scope = 'global_batch' with training.objective = 'dpo' is not supported yet; "
                        "use 'micro_batch'")


def check_lora(cfg: Config, handle: ModelHandle, weights: str | None, resuming: bool) -> None:
    """What [lora] needs of the model, the layout and the files (lora.adapter_path only for a
    fresh run: a resume continues from its checkpoint)."""
    if weights is None:
        raise UserError(f"lora.enabled: model.hf_path = {cfg.model.hf_path} has no *.safetensors weights; LoRA "
                        "trains adapters on a published base, so the base weights must be there")
    if cfg.parallelism.ep > 1 and handle.backend == "hf" and any(t.experts for t in handle.lora.targets):
        raise UserError("config key 'lora.target_modules': peft's adapters on transformers' fused experts "
                        "cannot be sharded by expert parallelism (parallelism.ep > 1); use model.spec = "
                        "'qwen3' (the same adapters, sharded with the experts) or leave experts.* out of "
                        "target_modules")
    if cfg.lora.adapter_path and not resuming:
        from titanite.models.lora import adapter

        folder = Path(cfg.lora.adapter_path)
        theirs, recorded = adapter.read_config(folder)
        mine = {t.short_name for t in handle.lora.targets}
        if (theirs.rank, theirs.alpha, set(theirs.target_modules)) != (cfg.lora.rank, cfg.lora.alpha, mine):
            raise UserError(f"config key 'lora.adapter_path': {folder} has rank {theirs.rank}, alpha {theirs.alpha:g} "
                            f"on {', '.join(sorted(theirs.target_modules))}, but [lora] asks for rank "
                            f"{cfg.lora.rank}, alpha {cfg.lora.alpha:g} on {', '.join(sorted(mine))}")
        adapter.check_base(folder, recorded, cfg.model.hf_path)
        adapter.check_adapter(folder, handle.lora.targets, cfg.lora, cfg.model.hf_path)
    n_train, n_all = lora.counts(handle.module)
    log.info("LoRA: %d adapters (rank %d, alpha %g) on %s; %s trainable of %s parameters (%.3f%%)",
             len(handle.lora.targets), cfg.lora.rank, cfg.lora.alpha,
             ", ".join(sorted({t.short_name for t in handle.lora.targets})), f"{n_train:,}", f"{n_all:,}",
             100 * n_train / n_all)


def check_eval_tasks(cfg: Config) -> None:
    """eval.tasks: lm-eval is installed, eval.include_path is a folder, and every task loads (its
    definition, its data and its generation settings, greedy ones only), so none fails mid-run."""
    from titanite.evaluation.heldout import require_lm_eval

    require_lm_eval("eval.tasks")
    from titanite.evaluation.harness import load_tasks

    load_tasks(cfg.eval.tasks, cfg.eval.include_path, "eval.tasks", sampling=False)


def check_input_paths(cfg: Config) -> None:
    """Every path the config names exists and has the right type (no FIFOs, sockets, devices)."""
    d = cfg.data
    if d.path and d.path != STDLIB and not d.dataset_name:
        require_regular(d.path, "data.path")
    for i, src in enumerate(d.sources):
        if src["path"] != STDLIB:
            require_regular(src["path"], f"data.sources[{i}].path")
    if cfg.eval.path:
        require_regular(cfg.eval.path, "eval.path")
    if d.tokenizer and d.tokenizer != "qwen3":
        require_regular(d.tokenizer, "data.tokenizer")
    if d.chat_template:
        require_regular(d.chat_template, "data.chat_template", folder_ok=False)
    if cfg.model.hf_path:
        p = require_regular(cfg.model.hf_path, "model.hf_path")
        if not p.is_dir():
            raise UserError(f"model.hf_path: {p} is a file; it must be a Hugging Face model folder "
                            "(config.json + *.safetensors)")


def weights_to_load(m: ModelConfig) -> str | None:
    """The folder whose safetensors a fresh (not resumed) run loads, or None for random init.

    `init = 'auto'` loads when the folder has safetensors; a folder whose only weights are
    pickles (pytorch_model.bin, *.pt) is refused rather than silently trained from random
    weights."""
    if m.init == "random" or not m.hf_path:
        return None
    folder = Path(m.hf_path)
    if any(folder.glob("*.safetensors")):
        return m.hf_path
    pickles = sorted(p.name for pattern in PICKLE_WEIGHTS for p in folder.glob(pattern))
    if pickles:
        raise UserError(
            f"model.hf_path: {folder} holds weights only as pickle files ({', '.join(pickles[:3])}); "
            "titanite reads safetensors only, because loading a pickle can run code. Convert once, "
            "on a machine you trust, with: python -c \"from transformers import AutoModelForCausalLM as M; "
            f"M.from_pretrained('{folder}').save_pretrained('{folder}-safetensors')\" and point "
            "model.hf_path there, or set model.init = 'random' to train from scratch")
    if m.init == "pretrained":
        raise UserError(f"config key 'model.init' is 'pretrained' but {folder} has no *.safetensors")
    log.info("model.hf_path %s has no weights: random init from its config.json", folder)
    return None


def check_data_stores(cfg: Config, tokenizer: Tokenizer, vocab_size: int) -> None:
    """A token store named by data.path, a source or eval.path must hold ids below the model's
    vocab_size and match the tokenizer, the run's settings and its sources' current files;
    anything else the run reads is cached in data.cache_dir, which must then be writable."""
    needs_cache = bool(cfg.data.dataset_name and not cfg.data.streaming)
    for key, data in run_data_configs(cfg):
        path = Path(data.path).expanduser() if data.path and data.path != STDLIB else None
        if path is None or not (path.is_dir() and token_store.is_store(path)):
            # a stream is tokenized while training: nothing of it is cached
            needs_cache |= bool(data.path) and not (key == "data.path" and cfg.data.streaming)
            continue
        store = token_store.open_store(path)
        if store.max_id >= vocab_size:
            raise UserError(f"{key}: the token store {path} holds ids up to {store.max_id}, but the model's "
                            f"vocab_size is {vocab_size}: every id must be below it. Prepare the store with this "
                            "model's tokenizer, or pick the model it was made for")
        token_store.check_fresh(store, data, tokenizer)
    if needs_cache:
        check_writable_folder(token_store.cache_dir(cfg.data), "data.cache_dir")


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Every id the tokenizer can produce must index the embedding."""
    if tokenizer.max_id >= vocab_size:
        raise UserError(f"the tokenizer {tokenizer.path} produces ids up to {tokenizer.max_id} (added and "
                        f"special tokens included), but the model's vocab_size is {vocab_size}: every id "
                        "must be below it. Pick a matching data.tokenizer or model (model.hf_path / "
                        "model.flavor)")


def _grad_accum_steps(cfg: Config, dp: int) -> int:
    t = cfg.training
    per_step = t.batch_size * dp
    global_batch = t.global_batch_size or per_step
    if global_batch % per_step:
        raise UserError(f"config key 'training.global_batch_size' ({global_batch}) must be a multiple of "
                        f"batch_size x data-parallel ranks ({t.batch_size} x {dp})")
    return global_batch // per_step

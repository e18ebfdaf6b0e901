"""`titanite generate`: text from a Hugging Face folder or a training checkpoint, with a KV cache.

Generation runs on the native Qwen3 modules. The training forward is left as it is: while
generating, each block's `attention` is swapped for a `CachedAttention` that uses the same
weights, appends the new keys/values to a preallocated cache and attends over everything
cached so far. The rest of each block (norms, dense or MoE feed-forward) runs unchanged, so
prefill and every decode step compute exactly what the full forward computes for those
positions.

Decoding is greedy (temperature 0) or sampled with temperature and nucleus (top-p)
filtering, seeded. Chat models (a tokenizer with a chat template) get their prompt rendered
with the template and its generation prompt, and stop at the end-of-turn token.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
from torch import nn

from titanite.data.chat_template import ChatTemplate, find_chat_template
from titanite.errors import UserError

log = logging.getLogger("titanite")


class KVCache:
    """Keys and values of every layer, preallocated: k, v are [L, B, Hk, max_len, D].

    `length` positions are filled; a forward over n new tokens writes positions
    [length, length + n) in every layer, then `advance(n)` commits them.
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    def advance(self, n: int) -> None:
        self.length += n


class CachedAttention(nn.Module):
    """Stands in for one block's `Attention` while generating (same weights, same math)."""

    def __init__(self, attention: nn.Module, cache: KVCache, layer: int) -> None:
        super().__init__()
        self.inner, self.cache, self.layer = attention, cache, layer

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, n, H] for positions [cache.length, cache.length + n) -> [B, n, H]."""
        assert document_ids is None, "generation runs one sequence per row"
        a, c = self.inner, self.cache
        B, n, _ = x.shape
        q = a.q_norm(a.wq(x).view(B, n, -1, a.head_dim)).transpose(1, 2)  # [B, Hq, n, D]
        k = a.k_norm(a.wk(x).view(B, n, -1, a.head_dim)).transpose(1, 2)  # [B, Hk, n, D]
        v = a.wv(x).view(B, n, -1, a.head_dim).transpose(1, 2)  # [B, Hk, n, D]
        q, k = a.rope(q, k, cos, sin)
        start, end = c.length, c.length + n
        if end > c.max_len:
            raise AssertionError(f"KV cache holds {c.max_len} positions, asked for {end}")
        c.k[self.layer, :, :, start:end] = k
        c.v[self.layer, :, :, start:end] = v
        keys, values = c.k[self.layer, :, :, :end], c.v[self.layer, :, :, :end]  # [B, Hk, end, D]
        # Query i sits at position start + i and sees keys 0..start + i. One new token sees all
        # (no mask); a first chunk is plain causal; a later chunk needs the offset mask.
        mask, causal = None, False
        if n > 1 and start == 0:
            causal = True
        elif n > 1:
            mask = torch.arange(end, device=x.device)[None, :] <= torch.arange(start, end, device=x.device)[:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                             scale=a.head_dim ** -0.5, enable_gqa=q.shape[1] != keys.shape[1])
        return a.wo(out.transpose(1, 2).reshape(B, n, -1))


def new_cache(model: nn.Module, batch: int, max_len: int) -> KVCache:
    """An empty cache sized for `model` (a native Qwen3), in its parameters' dtype and device."""
    a = model.args
    p = next(model.parameters())
    return KVCache(a.num_layers, batch, a.num_kv_heads, a.head_dim, max_len, p.dtype, p.device)


@contextlib.contextmanager
def cached_attention(model: nn.Module, cache: KVCache) -> Iterator[None]:
    """Within the block, every layer's attention reads and extends `cache`."""
    originals = [layer.attention for layer in model.layers]
    try:
        for i, layer in enumerate(model.layers):
            layer.attention = CachedAttention(originals[i], cache, i)
        yield
    finally:
        for layer, original in zip(model.layers, originals, strict=True):
            layer.attention = original


def forward_cached(model: nn.Module, ids: torch.Tensor, cache: KVCache, last_only: bool = True) -> torch.Tensor:
    """Logits for `ids` [B, n] continuing the cached sequence: [B, V] for the last position
    (last_only), else [B, n, V]. Call inside `cached_attention(model, cache)`."""
    n = ids.shape[1]
    positions = torch.arange(cache.length, cache.length + n, device=ids.device).expand(ids.shape[0], -1)
    h = model.hidden_states(ids, position_ids=positions)  # [B, n, H]
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
def generate(model: nn.Module, prompt: Sequence[int], sampling: Sampling,
             stop_ids: Sequence[int] = ()) -> list[int]:
    """New token ids after `prompt`, up to max_new_tokens; a stop id ends it (and is included)."""
    device = next(model.parameters()).device
    cache = new_cache(model, 1, len(prompt) + sampling.max_new_tokens)
    generator = torch.Generator(device).manual_seed(sampling.seed) if sampling.temperature > 0 else None
    stops = set(stop_ids)
    out: list[int] = []
    was_training = model.training
    model.eval()
    try:
        with cached_attention(model, cache):
            logits = forward_cached(model, torch.tensor([list(prompt)], device=device), cache)
            while len(out) < sampling.max_new_tokens:
                token = sample_next(logits, sampling, generator)  # [1]
                out.append(int(token))
                if out[-1] in stops or len(out) == sampling.max_new_tokens:
                    break
                logits = forward_cached(model, token[:, None], cache)
    finally:
        model.train(was_training)
    return out


# -- loading ------------------------------------------------------------------------------


@dataclass
class Generator:
    """A model ready to generate, with what it needs to read prompts and write text."""

    model: nn.Module
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
                   device: str | torch.device = "cpu", trust_remote_code: bool = False) -> Generator:
    """A Generator for a Hugging Face folder, a training checkpoint folder (checkpoints/step-N),
    or a run's output_dir (its latest checkpoint). Raises UserError for anything else."""
    from titanite.checkpoint import training_state

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"--model: {folder} is not a folder")
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


def _from_hf_folder(folder: Path, tokenizer_folder: Path, chat_template: str,
                    dtype: torch.dtype, device: str | torch.device) -> Generator:
    from titanite.api import load_pretrained
    from titanite.data.tokenizer import load_tokenizer

    model = load_pretrained(folder, spec="qwen3", dtype=dtype, device=device)
    tokenizer = load_tokenizer(str(tokenizer_folder))
    return _assemble(model, tokenizer.path, chat_template, [folder, tokenizer_folder])


def _from_checkpoint(checkpoint: Path, dtype: torch.dtype, device: str | torch.device,
                     trust_remote_code: bool) -> Generator:
    from titanite.checkpoint.hf_weights import export_hf
    from titanite.data.tokenizer import load_tokenizer
    from titanite.export import load_checkpoint_model

    cfg, spec, model = load_checkpoint_model(checkpoint, trust_remote_code)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    sources = [Path(cfg.model.hf_path)] if cfg.model.hf_path else []
    if spec.name != "qwen3":
        # Another backend's model: go through its HF export, which the native model loads.
        with tempfile.TemporaryDirectory() as tmp:
            export_hf(spec.hf_state_dict(model), spec.hf_config(model), Path(tmp) / "hf", 5000)
            del model
            return _from_hf_folder(Path(tmp) / "hf", tokenizer.path.parent, cfg.data.chat_template,
                                   dtype, device)
    model.to(device=device, dtype=dtype)
    spec.init_buffers(model)
    return _assemble(model.eval(), tokenizer.path, cfg.data.chat_template, sources)


def _assemble(model: nn.Module, tokenizer_json: Path, chat_template: str, folders: list[Path]) -> Generator:
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

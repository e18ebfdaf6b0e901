"""Preference data: rows of (prompt, chosen, rejected) -> pairs of token sequences.

Rows come from JSON lines, parquet or a `datasets` save_to_disk folder, in TRL's two forms:
- standard: three strings. The tokenizer's EOS (tokenizer_config.json's eos_token, '<|im_end|>'
  for Qwen3's instruct models; not the document separator) is appended to each completion
  (unless it ends with it already), and special tokens written in the text are parsed as such
  (chat markup in a prompt), as TRL does with transformers' tokenizer.
- conversational: `prompt` a list of {role, content} messages, `chosen` and `rejected` lists of
  assistant messages. The prompt is rendered with the generation prompt, prompt + completion
  without it, both with the tokenizer's chat template (chat_template.py), so the completion
  carries the template's end of turn (`<|im_end|>\\n` for Qwen3).

As in TRL 1.16, the completion starts where the tokenized prompt and the tokenized prompt +
completion stop agreeing (a template may render the prompt alone differently), and the
sequence prompt + completion is cut to data.seq_len (TRL's max_length) by
data.truncation_mode. data.max_prompt_length keeps a prompt's last tokens and
max_completion_length a completion's first ones, before that cut.

A pair is stored as two samples of the token store, chosen then rejected; labels are the next
token on completion tokens only. A row that is missing a field, has the wrong types, or whose
prompt leaves no completion token under max_length is malformed (data.on_malformed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from titanite.core.config import DataConfig
from titanite.core.errors import UserError
from titanite.data.chat import ChatStats, MalformedRow, check_messages, file_rows, refuse_media
from titanite.data.chat_template import ChatTemplate
from titanite.data.sources import _is_saved_dataset, load_saved_dataset, read_parquet
from titanite.data.tokenizer import Tokenizer
from titanite.kernels.reference_ops import IGNORE_INDEX

FIELDS = ("prompt", "chosen", "rejected")

Pair = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def is_conversational(row: dict[str, Any]) -> bool:
    return isinstance(row.get("prompt"), list)


def check_row(row: Any) -> dict[str, Any]:
    """The row's three fields, checked for presence and form. Raises MalformedRow."""
    if not isinstance(row, dict):
        raise MalformedRow(f"expected an object with {', '.join(FIELDS)}, got {type(row).__name__}")
    refuse_media(row)
    missing = [f for f in FIELDS if row.get(f) is None]
    if missing:
        raise MalformedRow(f"no field {' or '.join(map(repr, missing))}; a preference row holds prompt, chosen and "
                           f"rejected (the row has {sorted(row)})")
    kinds = {f: isinstance(row[f], list) for f in FIELDS}
    if len(set(kinds.values())) != 1 or not all(isinstance(row[f], (str, list)) for f in FIELDS):
        raise MalformedRow("prompt, chosen and rejected must be three strings (standard form) or three lists of "
                           "messages (conversational form), not a mix: got "
                           + ", ".join(f"{f}: {type(row[f]).__name__}" for f in FIELDS))
    if kinds["prompt"]:
        for f in ("chosen", "rejected"):
            if not row[f] or any(not isinstance(m, dict) or m.get("role") != "assistant" for m in row[f]):
                raise MalformedRow(f"{f!r} must be a non-empty list of assistant messages")
    return row


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(row: dict[str, Any], tokenizer: Tokenizer, template: ChatTemplate | None
                  ) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen completion ids, rejected completion ids), as TRL 1.16 tokenizes them."""
    if is_conversational(row):
        if template is None:
            raise MalformedRow("a conversational row needs a chat template, and the tokenizer has none "
                               "(set data.chat_template)")
        prompt = row["prompt"]
        for f in ("chosen", "rejected"):  # roles, contents and special tokens, as for chat data
            check_messages({"m": prompt + row[f]}, "m", template)
        clean = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        prompt_ids = template.encode_prompt(clean)
        full = [template.encode(template.render(clean + [{k: v for k, v in m.items() if v is not None}
                                                         for m in row[f]]))[0] for f in ("chosen", "rejected")]
    else:
        # As TRL: the EOS text (tokenizer_config.json's eos_token) appended unless already there, and
        # special tokens in the text parsed as such, as transformers' tokenizer parses them.
        eos = tokenizer.completion_eos
        texts = [row["prompt"]] + [row["prompt"] + (row[f] if row[f].endswith(eos) else row[f] + eos)
                                   for f in ("chosen", "rejected")]
        prompt_ids, *full = tokenizer.encode_markup(texts)
    n = min(common_prefix_length(prompt_ids, ids) for ids in full)
    return prompt_ids[:n], full[0][n:], full[1][n:]


def fit_pair(prompt: list[int], completions: list[list[int]], cfg: DataConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each completion after the prompt, cut as configured, as (ids, labels) int32 arrays.
    Raises MalformedRow when the prompt leaves no completion token."""
    if cfg.max_prompt_length:
        prompt = prompt[-cfg.max_prompt_length:]
    max_length = cfg.seq_len
    if cfg.truncation_mode == "keep_start" and len(prompt) >= max_length:
        raise MalformedRow(f"the prompt is {len(prompt)} tokens, which leaves no room for the completion under "
                           f"data.seq_len = {max_length} (TRL's max_length); raise data.seq_len, set "
                           "data.max_prompt_length, or data.truncation_mode = 'keep_end'")
    out = []
    for completion in completions:
        if cfg.max_completion_length:
            completion = completion[:cfg.max_completion_length]
        ids = prompt + completion
        mask = [False] * len(prompt) + [True] * len(completion)
        cut = slice(None, max_length) if cfg.truncation_mode == "keep_start" else slice(-max_length, None)
        ids, mask = ids[cut], mask[cut]
        labels = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
        out.append((np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32)))
    return out


def tokenize_preference_row(tokenizer: Tokenizer, template: ChatTemplate | None, cfg: DataConfig,
                            where: str, row: Any) -> Pair | tuple[str, MalformedRow]:
    """One row as its (chosen, rejected) samples, or (where, MalformedRow) saying why it cannot be."""
    try:
        if isinstance(row, MalformedRow):
            raise row
        prompt, chosen, rejected = tokenize_pair(check_row(row), tokenizer, template)
        pair = fit_pair(prompt, [chosen, rejected], cfg)
    except MalformedRow as e:
        return where, e
    return pair[0], pair[1]


def preference_rows(cfg: DataConfig, stats: ChatStats | None = None) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of data.path; a JSON line that does not parse comes as a
    MalformedRow, so data.on_malformed decides. Counts files read in `stats.files`."""
    stats = stats if stats is not None else ChatStats()
    if not cfg.path:
        raise UserError("no data: set data.path to a .jsonl/.parquet file, a folder of them, or a datasets folder "
                        "of preference rows (prompt, chosen, rejected)")
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise UserError(f"data.path: {path} does not exist")
    if path.is_dir() and _is_saved_dataset(path):
        ds = load_saved_dataset(path, cfg.split)
        stats.files += 1
        for i, row in enumerate(ds):
            yield f"{path} row {i}", row
        return
    # Whole rows from parquet: the three fields, in either form.
    yield from file_rows(path, cfg, stats, "preference", read_parquet)

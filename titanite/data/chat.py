"""Chat data: conversation rows -> (token ids, labels) samples with assistant-only loss.

A row holds `data.messages_field` (default "messages"): a list of `{role, content}` dicts, with
roles system / user / assistant / tool (extra keys such as `reasoning_content` or `tool_calls`
reach the template untouched). Rows come from JSON lines, parquet, or a `datasets`
save_to_disk folder. The conversation is rendered with the tokenizer's chat template (see
chat_template.py); `data.chat_loss` picks which tokens are learned.

A malformed row (not JSON, no messages, unknown role, no assistant turn, a special token such as
'<|im_end|>' written in the text, or a conversation the template rejects) stops the run naming
its file and line, or is skipped and counted when `data.on_malformed = "skip"`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from titanite.core.config import DataConfig
from titanite.core.errors import UserError
from titanite.data.chat_template import REASONING_FIELDS, ChatTemplate, ChatTemplateError, find_chat_template
from titanite.data.sources import (
    _decode,
    _is_saved_dataset,
    dataset_column,
    json_lines,
    load_saved_dataset,
    path_files,
    read_parquet,
)
from titanite.data.tokenizer import Tokenizer
from titanite.kernels.reference_ops import IGNORE_INDEX  # the labels the loss skips

log = logging.getLogger("titanite")

ROLES = ("system", "user", "assistant", "tool")
CHAT_GLOBS = ("**/*.jsonl", "**/*.parquet")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
_WARN_FIRST = 10  # malformed rows named in the log before only counting


class MalformedRow(ValueError):
    """This row cannot become a training sample; the message says why."""


class MediaInput(MalformedRow):
    """The row holds image or video inputs. titanite trains on text only for now, so this stops the
    run whatever data.on_malformed says: skipping would silently train on text cut from its images."""


MEDIA_COLUMNS = ("image", "images", "video", "videos")
MEDIA_PARTS = frozenset({"image", "image_url", "input_image", "video", "video_url", "input_video"})


def refuse_media(row: dict[str, Any]) -> None:
    """Raise MediaInput for an image or video column (TRL's vision datasets) or an image or video
    part in any message's content list."""
    for column in MEDIA_COLUMNS:
        if row.get(column) is not None and row.get(column) != []:
            raise MediaInput(f"the row has a {column!r} column")
    for field, value in row.items():
        for i, message in enumerate(value if isinstance(value, list) else []):
            content = message.get("content") if isinstance(message, dict) else None
            parts = content if isinstance(content, list) else []
            kinds = {part.get("type") for part in parts if isinstance(part, dict)}
            if kinds & MEDIA_PARTS:
                raise MediaInput(f"{field!r} message {i} has {sorted(kinds & MEDIA_PARTS)[0]!r} content")


@dataclass
class ChatStats:
    """What the chat source read and skipped; filled in while iterating."""

    files: int = 0
    rows: int = 0
    malformed_skipped: int = 0

    def summary(self) -> str:
        return f"{self.files} files, {self.rows} conversations ({self.malformed_skipped} malformed, skipped)"


def load_chat_template(cfg: DataConfig, tokenizer: Tokenizer) -> ChatTemplate:
    """The template chat data is rendered with; UserError when the tokenizer has none."""
    template = find_chat_template(tokenizer.path, cfg.chat_template)
    if template is None:
        raise UserError(f"data.format = 'chat' needs a chat template, and the tokenizer at "
                        f"{tokenizer.path.parent} has none (no chat_template.jinja, no chat_template in "
                        "tokenizer_config.json); set data.chat_template to a .jinja file")
    return template


def tokenize_conversation(template: ChatTemplate, messages: list[dict[str, Any]],
                          loss: str = "assistant") -> tuple[list[int], list[int]]:
    """Render and tokenize one conversation.

    Returns (input_ids, labels), two int lists of the same length T: labels[t] is the token at
    t + 1 when that token carries loss, else IGNORE_INDEX (always so at t = T - 1).
    `loss`: 'assistant', 'last_assistant' or 'all' (see data.chat_loss).
    Raises MalformedRow when the template fails or its assistant turns cannot be found.
    """
    try:
        text = template.render(messages)
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        spans = template.assistant_spans(text, n_assistant)
    except ChatTemplateError as e:
        raise MalformedRow(str(e)) from None
    ids, offsets = template.encode(text)
    if loss == "all":
        trained = [True] * len(ids)
    else:
        spans = spans[-1:] if loss == "last_assistant" else spans
        trained = _tokens_in_spans(offsets, spans)
    labels = [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    return ids, labels + [IGNORE_INDEX]


def _tokens_in_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Whether each token's characters overlap a span. Both lists are sorted by position."""
    out, j = [], 0
    for start, end in offsets:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        out.append(j < len(spans) and start < spans[j][1] and max(end, start + 1) > spans[j][0])
    return out


def check_messages(row: Any, field: str, template: ChatTemplate) -> list[dict[str, Any]]:
    """The row's message list, validated. Raises MalformedRow saying what is wrong."""
    if not isinstance(row, dict):
        raise MalformedRow(f"expected an object with {field!r}, got {type(row).__name__}")
    if field not in row:
        raise MalformedRow(f"no field {field!r} (data.messages_field); the row has {sorted(row)}")
    refuse_media(row)
    messages = row[field]
    if not isinstance(messages, list) or not messages:
        raise MalformedRow(f"{field!r} must be a non-empty list of messages, got {_short(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise MalformedRow(f"message {i} must be an object with 'role' and 'content', got {_short(m)}")
        if m["role"] not in ROLES:
            raise MalformedRow(f"message {i} has unknown role {m['role']!r}; roles: {', '.join(ROLES)}")
        for key in ("content", *REASONING_FIELDS):
            value = m.get(key)
            if key == "content" and not isinstance(value, str):
                raise MalformedRow(f"message {i} content must be a string, got {_short(value)}")
            if isinstance(value, str) and (tok := template.special_token_in(value)):
                # It would be parsed as markup: a fake end of turn, or a forged header.
                raise MalformedRow(f"message {i} {key} contains the special token {tok!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise MalformedRow("the conversation has no assistant turn, so nothing to learn")
    # parquet structs carry every key of the schema; a missing optional key arrives as None.
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def chat_samples(cfg: DataConfig, tokenizer: Tokenizer,
                 stats: ChatStats) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every usable conversation of the configured source, as (ids, labels) int32 arrays [T].

    Over-long samples are returned whole: fitting them to seq_len is packing's job. (The token
    store runs the same three steps with tokenize_row in worker processes.)
    """
    template = load_chat_template(cfg, tokenizer)
    for where, row in chat_rows(cfg, stats):
        sample = apply_policy(cfg, tokenize_row(template, cfg, where, row), stats)
        if sample is not None:
            yield sample
    finish_policy(stats)


def chat_rows(cfg: DataConfig, stats: ChatStats) -> Iterator[tuple[str, Any]]:
    """(where, row) of every row of the source, in order, counted in stats.rows."""
    for item in _rows(cfg, stats):
        stats.rows += 1
        yield item


def tokenize_row(template: ChatTemplate, cfg: DataConfig, where: str, row: Any
                 ) -> tuple[np.ndarray, np.ndarray] | tuple[str, MalformedRow]:
    """One row as (ids, labels) int32 arrays, or (where, MalformedRow) saying why it cannot be."""
    try:
        if isinstance(row, MalformedRow):
            raise row
        messages = check_messages(row, cfg.messages_field, template)
        ids, labels = tokenize_conversation(template, messages, cfg.chat_loss)
    except MalformedRow as e:
        return where, e
    return np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32)


def apply_policy(cfg: DataConfig, result: Any, stats: ChatStats) -> tuple[np.ndarray, np.ndarray] | None:
    """data.on_malformed applied to a tokenize_row result: the sample, None (skipped, counted and
    the first few named in the log), or UserError naming file and line."""
    first, second = result
    if not isinstance(second, MalformedRow):
        return first, second
    if isinstance(second, MediaInput):
        raise UserError(f"{first}: {second}: titanite trains on text only for now; remove the image and video "
                        "inputs from the data (a multimodal checkpoint's vision tower is carried through untouched)")
    if cfg.on_malformed == "error":
        raise UserError(f"{first}: {second} (set data.on_malformed = 'skip' to leave such rows out)")
    stats.malformed_skipped += 1
    if stats.malformed_skipped <= _WARN_FIRST:
        log.warning("skipping malformed chat row %s: %s", first, second)
    return None


def finish_policy(stats: ChatStats) -> None:
    if stats.malformed_skipped > _WARN_FIRST:
        log.warning("skipped %d malformed chat rows in all", stats.malformed_skipped)


def _rows(cfg: DataConfig, stats: ChatStats) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row; `where` is 'file:line' or 'file row N'. A JSON line that does
    not parse comes as a MalformedRow instance, so the policy decides."""
    if cfg.dataset_name:
        raise UserError("data.format = 'chat' reads data.path; save the hub dataset with "
                        "save_to_disk (or as parquet/JSON lines) and point data.path at it")
    if not cfg.path:
        raise UserError("no data: set data.path to a .jsonl/.parquet file or folder of chat rows")
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise UserError(f"data.path: {path} does not exist")
    if path.is_dir() and _is_saved_dataset(path):
        stats.files += 1
        yield from _dataset_rows(path, cfg)
        return
    yield from file_rows(path, cfg, stats, "chat", lambda f: _parquet_rows(f, cfg.messages_field))


def file_rows(path: Path, cfg: DataConfig, stats: ChatStats, fmt: str,
              parquet_rows: Callable[[Path], Iterator[tuple[str, Any]]]) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of the .jsonl/.json/.parquet files of data.path (a file or a
    folder; data.format = `fmt`), in order; `where` is 'file:line' or 'file row N'. A parquet
    file's rows come from `parquet_rows`. A JSON line that does not parse comes as a MalformedRow
    instance, so the policy decides. Counts the files read in stats.files."""
    for f in path_files(path, cfg, CHAT_GLOBS):
        kind = _SUFFIXES.get(f.suffix.lower())
        if kind is None:
            raise UserError(f"{f}: data.format = '{fmt}' reads .jsonl or .parquet files, not '{f.suffix}'")
        if kind == "parquet":
            stats.files += 1
            yield from parquet_rows(f)
            continue
        text = _decode(f, cfg.on_decode_error)
        if text is None:
            continue
        stats.files += 1
        for where, row in json_lines(f, text):
            if isinstance(row, json.JSONDecodeError):
                row = MalformedRow(f"not valid JSON ({row.msg} at column {row.colno})")
            yield where, row


def _parquet_rows(f: Path, field: str) -> Iterator[tuple[str, Any]]:
    for where, value in read_parquet(f, field, "data.messages_field"):
        yield where, {field: value}


def _dataset_rows(path: Path, cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    ds = load_saved_dataset(path, cfg.split)
    for where, value in dataset_column(ds, str(path), cfg.messages_field, "data.messages_field"):
        yield where, {cfg.messages_field: value}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""Chat templates: render a conversation with the tokenizer's own Jinja template, tokenize it as
the model will see it at inference, and find which tokens the assistant wrote.

Rendering goes through transformers' `render_jinja_template`, the function behind
`apply_chat_template`, so a conversation becomes exactly the text users get elsewhere (Qwen3's
empty `<think>` block on the final turn included).

Most templates, Qwen3's among them, carry no `{% generation %}` markers, and rendering a
prefix of a conversation is not a prefix of the whole rendering (Qwen3 emits the think block
only after the last user turn). So assistant turns are found in the full rendering itself:

- the *header* is what `add_generation_prompt` appends (`<|im_start|>assistant\n` for Qwen3),
  taken from the template by rendering a one-message probe with and without it;
- each assistant turn starts right after a header and ends with the first special token after it
  (`<|im_end|>`), which is included: the model must learn to stop.

That search is unambiguous because message text may not contain special tokens (such rows are
rejected, see `chat.py`), so every header in the rendering was written by the template.

A template sees what `apply_chat_template` gives it: `messages`, `add_generation_prompt`,
`tools` and `documents` (none here), the tokenizer's named special tokens (`eos_token`,
`bos_token`, `pad_token`, ... from tokenizer_config.json), and transformers' globals
(`raise_exception`, `strftime_now`, `namespace`, the `tojson` filter), in transformers' own
sandboxed environment. One thing differs on purpose: printing a name that is not defined is an
error, where Jinja's default prints nothing. A template that writes `{{ eos_token }}` for a
tokenizer without one would otherwise train on text the model never sees at inference. Tests
(`if x`, `x is defined`, `x | default(...)`) of an undefined name still work as in Jinja.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import tokenizers

from titanite.core.errors import UserError

_PROBE = [{"role": "user", "content": "probe"}]
# The named special tokens transformers passes to every template (its `special_tokens_map`).
# The message keys transformers renders as a message's reasoning (`_REASONING_FIELDS`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def special_tokens_map(tokenizer_json: Path) -> dict[str, str]:
    """The named special tokens of the tokenizer whose tokenizer.json is `tokenizer_json`, as
    transformers reads them: tokenizer_config.json beside it, filled in from the legacy
    special_tokens_map.json. A value is a string or an AddedToken dict (its `content`); null is
    absent."""
    found: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = tokenizer_json.parent / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"cannot parse {path}: {e}") from None
        for key in SPECIAL_TOKEN_NAMES:
            value = config.get(key) if isinstance(config, dict) else None
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and value and key not in found:
                found[key] = value
    return found


@functools.cache
def _template_environment():
    """transformers' chat-template environment (sandbox, filters, globals), with undefined names
    that raise when printed instead of rendering as ''."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    class PrintingUndefinedIsAnError(jinja2.Undefined):
        __slots__ = ()

        def __str__(self) -> str:
            self._fail_with_undefined_error()

    return _compile_jinja_template("").environment.overlay(undefined=PrintingUndefinedIsAnError)


class ChatTemplateError(ValueError):
    """The template cannot render this conversation, or its assistant turns cannot be found."""


class ChatTemplate:
    """A chat template bound to the tokenizer that encodes its renderings.

    Args:
        source: the Jinja template text.
        where: where it came from (a file, or a key in tokenizer_config.json), for messages.
        tokenizer_json: the tokenizer.json to encode with; added tokens in the rendering
            (`<|im_start|>`, `<think>`, ...) become their single ids.
    """

    def __init__(self, source: str, where: str, tokenizer_json: Path) -> None:
        self.source, self.where = source, where
        self.special_tokens_map = special_tokens_map(tokenizer_json)
        try:
            self._template = _template_environment().from_string(source)
        except Exception as e:  # jinja2.TemplateSyntaxError and the sandbox's errors
            raise UserError(f"{where}: the chat template does not parse: {e}") from None
        self._tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        added = self._tok.get_added_tokens_decoder().values()
        self.special_tokens = sorted((t.content for t in added if t.special), key=len, reverse=True)
        if not self.special_tokens:
            raise UserError(f"{where}: the tokenizer {tokenizer_json} has no special tokens, so the end "
                            "of an assistant turn cannot be found")
        self._special_re = re.compile("|".join(map(re.escape, self.special_tokens)))
        try:
            self.header = self.render(_PROBE, add_generation_prompt=True).removeprefix(self.render(_PROBE))
        except ChatTemplateError as e:
            raise UserError(f"{where}: the chat template fails on a one-message conversation: {e}") from None
        if not self.header:
            raise UserError(f"{where}: the chat template adds nothing for add_generation_prompt, so "
                            "assistant turns cannot be found; use a template that supports it "
                            "(data.chat_template)")
        self.end_of_turn = self._end_of_turn()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation as text, exactly as `apply_chat_template(tokenize=False)` renders it
        (with the same variables and message preparation), except that printing an undefined name
        raises."""
        import jinja2
        from transformers.utils.chat_template_utils import _alias_reasoning_fields, _plain_template_data

        try:
            return self._template.render(
                messages=_alias_reasoning_fields(_plain_template_data(messages)), tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        except jinja2.UndefinedError as e:
            given = ", ".join(sorted(self.special_tokens_map)) or "none"
            raise ChatTemplateError(
                f"the chat template ({self.where}) prints an undefined value: {e}. A template gets messages, "
                f"add_generation_prompt, tools, documents and the tokenizer's named special tokens "
                f"(this tokenizer's tokenizer_config.json defines: {given})") from None
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(f"the chat template ({self.where}) fails: {e}") from None

    def special_token_in(self, text: str) -> str | None:
        """The first special token (e.g. '<|im_end|>') written literally in `text`, or None."""
        m = self._special_re.search(text)
        return m.group(0) if m else None

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of a rendering (added tokens parsed), with each token's character span."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def encode_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Ids of the conversation followed by the generation prompt: what to generate from."""
        return self.encode(self.render(messages, add_generation_prompt=True))[0]

    def assistant_spans(self, text: str, expected: int) -> list[tuple[int, int]]:
        """Character spans [start, end) of the assistant turns in a rendering, end-of-turn token
        included. Raises ChatTemplateError unless there are exactly `expected` of them."""
        spans = []
        pos = text.find(self.header)
        while pos >= 0:
            start = pos + len(self.header)
            end_tok = self._special_re.search(text, start)
            if end_tok is None:
                raise ChatTemplateError(f"an assistant turn at character {start} has no end-of-turn "
                                        f"token (one of the tokenizer's special tokens) after it")
            spans.append((start, end_tok.end()))
            pos = text.find(self.header, end_tok.end())
        if len(spans) != expected:
            raise ChatTemplateError(f"the chat template ({self.where}) renders {len(spans)} assistant "
                                    f"turns (header {self.header!r}) for {expected} assistant messages")
        return spans

    def _end_of_turn(self) -> str:
        """The special token that closes an assistant turn ('<|im_end|>' for Qwen3)."""
        probe = _PROBE + [{"role": "assistant", "content": "probe"}]
        try:
            text = self.render(probe)
            (start, end), = self.assistant_spans(text, expected=1)
        except ChatTemplateError as e:
            raise UserError(f"{self.where}: cannot find the assistant turn in a rendered two-message "
                            f"conversation: {e}") from None
        eot = self._special_re.search(text, start)
        assert eot is not None and eot.end() == end
        return eot.group(0)

    def token_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        assert tid is not None, token
        return tid


def find_chat_template(tokenizer_json: Path, override: str = "") -> ChatTemplate | None:
    """The chat template for a tokenizer: `override` (a .jinja file, i.e. data.chat_template) when
    set, else chat_template.jinja or tokenizer_config.json's `chat_template` beside
    tokenizer.json. None when the tokenizer has none."""
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise UserError(f"data.chat_template: file not found: {path}")
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path), tokenizer_json)
    folder = tokenizer_json.parent
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), str(jinja_file), tokenizer_json)
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"cannot parse {config}: {e}") from None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        return None
    return ChatTemplate(template, f"{config} (chat_template)", tokenizer_json)

"""Chat data: rendering with the tokenizer's own template, assistant-only labels, loss policies,
over-long and malformed rows. Oracles: a conversation labelled by hand, and transformers'
`apply_chat_template(return_assistant_tokens_mask=True)` on Qwen3's template with
`{% generation %}` markers added around each assistant turn."""

from __future__ import annotations

import json
import logging

import pytest
import tokenizers
import transformers

from tests.fixtures.chat import qwen3_chat_template, qwen3_tokenizer_dir, write_jsonl
from titanite.core.config import DataConfig
from titanite.core.errors import UserError
from titanite.data import load_tokenizer
from titanite.data.chat import IGNORE_INDEX, ChatStats, chat_samples, tokenize_conversation
from titanite.data.chat_template import find_chat_template
from titanite.data.loader import PackedLoader

SYSTEM = {"role": "system", "content": "You are terse."}


def conv(*turns: str, system: bool = False) -> list[dict]:
    """user, assistant, user, assistant, ... messages from alternating texts."""
    msgs = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    return [SYSTEM, *msgs] if system else msgs


ORACLE_CONVERSATIONS = [
    conv("Hi", "Hello!", system=True),
    conv("one?", "1", "two?", "2", "three?", "3"),
    conv("Grüße, 你好 😀", "Grüße zurück 😀 — 你好!", "and again?", "  spaced  \n\n answer\n"),
    [{"role": "user", "content": "think first"},
     {"role": "assistant", "content": "done", "reasoning_content": "Let me think.\nOK."}],
    [*conv("q1", "<think>\nhidden\n</think>\n\nvisible"), *conv("q2", "a2")],
    [{"role": "user", "content": "weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny, 21C"},
     {"role": "assistant", "content": "Sunny and 21C."}],
]


@pytest.fixture(scope="module")
def qwen3_template():
    return find_chat_template(qwen3_tokenizer_dir() / "tokenizer.json")


@pytest.fixture(scope="module")
def hf_qwen3_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def qwen3_template_with_generation_markers() -> str:
    """Qwen3's template with {% generation %} around everything an assistant turn writes after
    '<|im_start|>assistant\\n', up to and including '<|im_end|>'. Renders the same text."""
    t = qwen3_chat_template()
    t = _replace_once(t, "{{- '<|im_start|>' + message.role + '\\n<think>\\n' +", "{{- '<think>\\n' +")
    assert t.count("{{- '<|im_start|>' + message.role + '\\n' + content }}") == 2
    t = t.replace("{{- '<|im_start|>' + message.role + '\\n' + content }}", "{{- content }}")
    t = _replace_once(t, "{%- if loop.index0 > ns.last_query_index %}",
                      "{{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}\n"
                      "        {%- if loop.index0 > ns.last_query_index %}")
    return _replace_once(t, "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
                         "{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}\n"
                         "    {%- elif message.role == \"tool\" %}")


def trained_positions(labels: list[int]) -> list[int]:
    """Token positions that are learned: t + 1 for every labelled t."""
    return [t + 1 for t, label in enumerate(labels) if label != IGNORE_INDEX]


def test_labels_of_a_known_conversation_are_exact(qwen3_template):
    # Written out by hand from Qwen3's template: only the final assistant turn (after the last
    # user message) gets the empty think block; turns end with <|im_end|> and a newline.
    pieces = [
        ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("Hello!<|im_end|>", True),
        ("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think>\n\n</think>\n\nSee you.<|im_end|>", True),
        ("\n", False),
    ]
    messages = conv("Hi", "Hello!", "Bye", "See you.", system=True)
    assert qwen3_template.render(messages) == "".join(text for text, _ in pieces)

    tok = tokenizers.Tokenizer.from_file(str(qwen3_tokenizer_dir() / "tokenizer.json"))
    want_ids, learned = [], []
    for text, trained in pieces:
        ids = tok.encode(text, add_special_tokens=False).ids
        want_ids += ids
        learned += [trained] * len(ids)
    want_labels = [want_ids[t + 1] if learned[t + 1] else IGNORE_INDEX for t in range(len(want_ids) - 1)]
    want_labels.append(IGNORE_INDEX)

    ids, labels = tokenize_conversation(qwen3_template, messages)
    assert ids == want_ids
    assert labels == want_labels
    # The end-of-turn token is learned, so the model learns to stop.
    im_end = tok.token_to_id("<|im_end|>")
    assert [want_ids[p] for p in trained_positions(labels)].count(im_end) == 2


@pytest.mark.parametrize("messages", ORACLE_CONVERSATIONS, ids=range(len(ORACLE_CONVERSATIONS)))
def test_assistant_tokens_match_transformers_generation_mask(qwen3_template, hf_qwen3_tokenizer, messages):
    oracle_template = qwen3_template_with_generation_markers()
    hf_tok = hf_qwen3_tokenizer
    text = hf_tok.apply_chat_template(messages, tokenize=False)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, chat_template=oracle_template)
    out = hf_tok.apply_chat_template(messages, chat_template=oracle_template, tokenize=True,
                                     return_dict=True, return_assistant_tokens_mask=True)
    want_ids = list(out["input_ids"])
    want = [t for t, m in enumerate(out["assistant_masks"]) if m]
    assert want and want[0] > 0

    ids, labels = tokenize_conversation(qwen3_template, messages)
    assert ids == want_ids
    assert trained_positions(labels) == want
    assert labels == [ids[t + 1] if t + 1 in set(want) else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def test_loss_policies(qwen3_template):
    messages = conv("a?", "one", "b?", "two", system=True)
    ids, assistant = tokenize_conversation(qwen3_template, messages, "assistant")
    ids_last, last = tokenize_conversation(qwen3_template, messages, "last_assistant")
    ids_all, every = tokenize_conversation(qwen3_template, messages, "all")
    assert ids == ids_last == ids_all
    assert every == ids[1:] + [IGNORE_INDEX]
    # The last turn alone is the tail of the assistant positions, after the second header.
    pos_all, pos_last = trained_positions(assistant), trained_positions(last)
    assert pos_last and set(pos_last) < set(pos_all)
    text = qwen3_template.render(messages)
    last_header = text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    prefix_len = len(qwen3_template.encode(text[:last_header])[0])
    assert pos_last == [p for p in pos_all if p >= prefix_len]


def chat_cfg(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), format="chat", tokenizer=str(qwen3_tokenizer_dir()), **kw)


def test_malformed_rows_stop_or_are_skipped_and_counted(tmp_path, qwen3_template, caplog):
    good = {"messages": conv("hi", "hello")}
    rows = [
        good,
        '{"messages": [',  # line 2: not JSON
        {"text": "no messages"},  # 3
        {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},  # 4
        {"messages": conv("only a question")},  # 5: no assistant turn
        {"messages": conv("hi", "fake<|im_end|>end")},  # 6: special token in text
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},  # 7
        {"messages": []},  # 8
        # 9: a forged end of turn under a name transformers renders as the reasoning
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "<|im_end|>"}]},
        good,
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    with pytest.raises(UserError, match=r"chat\.jsonl:2: not valid JSON"):
        list(chat_samples(chat_cfg(path), tok, ChatStats()))
    stats = ChatStats()
    with caplog.at_level(logging.WARNING, logger="titanite"):
        samples = list(chat_samples(chat_cfg(path, on_malformed="skip"), tok, stats))
    expected = {2: "not valid JSON", 3: "no field 'messages'", 4: "unknown role 'narrator'",
                5: "no assistant turn", 6: "special token '<|im_end|>'", 7: "content must be a string",
                8: "non-empty list", 9: "thinking contains the special token '<|im_end|>'"}
    warnings = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == len(expected)
    for (line, why), message in zip(expected.items(), warnings, strict=True):
        assert f"chat.jsonl:{line}: " in message and why in message, message
    want_ids, want_labels = tokenize_conversation(qwen3_template, good["messages"])
    assert len(samples) == 2 and (stats.rows, stats.malformed_skipped) == (10, 8)
    for ids, labels in samples:
        assert ids.tolist() == want_ids and labels.tolist() == want_labels
    loader = PackedLoader(chat_cfg(path, on_malformed="skip", seq_len=64), tok, 1, 0)
    assert loader.data_metrics()["data_malformed"] == 8 and loader.data_metrics()["data_samples"] == 2


def test_overlong_samples_are_truncated_or_dropped(tmp_path, qwen3_template):
    rows = [{"messages": conv("short", "ok")},
            {"messages": conv("tell me a long story", " ".join(["word"] * 60))},
            {"messages": conv(" ".join(["long question"] * 40), "answer")}]  # cut before the answer
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    full = [tokenize_conversation(qwen3_template, r["messages"]) for r in rows]
    assert len(full[0][0]) <= 40 < min(len(full[1][0]), len(full[2][0]))

    cut = PackedLoader(chat_cfg(path, seq_len=40, packing="pad", shuffle=False), tok, 1, 0)
    m = cut.data_metrics()
    assert (m["data_samples"], m["data_truncated"], m["data_dropped"], m["data_malformed"]) == (2, 1, 1, 0)
    assert m["data_fill"] == pytest.approx((len(full[0][0]) + 40) / 80)
    cut.next_batch()
    second = cut.next_batch()  # the long story, cut to 40 tokens
    assert second["input_ids"][0].tolist() == full[1][0][:40]
    assert second["labels"][0].tolist() == full[1][1][:40]  # the label at the cut is the true next token

    dropped = PackedLoader(chat_cfg(path, seq_len=40, packing="pad", overlong="drop"), tok, 1, 0)
    m = dropped.data_metrics()
    assert (m["data_samples"], m["data_truncated"], m["data_dropped"]) == (1, 0, 2)


def test_parquet_and_datasets_rows_match_jsonl(tmp_path):
    import datasets

    rows = [{"messages": conv("hi", "hello", system=True)}, {"messages": conv("x?", "y", "z?", "w")}]
    jsonl = write_jsonl(tmp_path / "c.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "c.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))

    def read(path):
        return [(i.tolist(), label.tolist()) for i, label in chat_samples(chat_cfg(path), tok, ChatStats())]

    want = read(jsonl)
    assert len(want) == 2
    assert read(tmp_path / "c.parquet") == want
    assert read(tmp_path / "saved") == want


def test_missing_chat_template_names_the_tokenizer(tmp_path, tiny_tokenizer_dir):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": conv("hi", "hello")}])
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    with pytest.raises(UserError, match="needs a chat template.*data.chat_template"):
        list(chat_samples(DataConfig(path=str(path), format="chat"), tok, ChatStats()))
    # An explicit template file is used instead of the tokenizer's (none here).
    (tmp_path / "t.jinja").write_text(qwen3_chat_template())
    with pytest.raises(UserError, match="special tokens"):  # the tiny tokenizer has no <|im_end|>
        list(chat_samples(DataConfig(path=str(path), format="chat", chat_template=str(tmp_path / "t.jinja")),
                          tok, ChatStats()))


def test_chat_config_rejects_stream_packing():
    from titanite.core.config import load_config

    with pytest.raises(UserError, match="data.packing"):
        load_config(None, ["--data.format=chat", "--data.packing=stream"])


# -- templates of one's own render as transformers renders them ------------------------------

_TURN = "{{- '<|im_start|>' + m.role + '\\n' }}"
_GEN = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
OWN_TEMPLATES = {
    # the end of turn printed from the tokenizer's eos_token (was rendered as '')
    "printed eos_token": "{%- for m in messages %}" + _TURN + "{{- m.content }}{{- eos_token }}{{- '\\n' }}"
                         "{%- endfor %}" + _GEN,
    # concatenated with it (was "'eos_token' is undefined")
    "concatenated tokens": "{{- bos_token }}{%- for m in messages %}"
                           "{{- '<|im_start|>' + m.role + '\\n' + m.content + eos_token + '\\n' }}{%- endfor %}" + _GEN,
    # transformers' globals and filters, and tests of names nobody defines
    "globals": "{%- set ns = namespace(n=0) %}{%- for m in messages %}"
               "{%- if m.role not in ['system', 'user', 'assistant'] %}{{- raise_exception('bad role') }}{%- endif %}"
               "{%- set ns.n = ns.n + 1 %}" + _TURN + "{{- m.content }}"
               "{%- if m.reasoning_content is defined %}[{{ m.reasoning_content | tojson }}]{%- endif %}"
               "{{- '<|im_end|>\\n' }}{%- endfor %}"
               "{%- if tools %}{{ tools | tojson }}{%- endif %}{%- if enable_thinking is defined %}x{%- endif %}"
               "{{- '<!-- ' + strftime_now('%Y') + ' -->' if ns.n > 99 else '' }}{{- pad_token }}" + _GEN,
}


@pytest.fixture(scope="module")
def own_tokenizer_dir(tmp_path_factory):
    """Qwen3's tokenizer files with a bos_token set, so every named special token kind is seen."""
    import shutil

    folder = tmp_path_factory.mktemp("own-tok")
    for f in qwen3_tokenizer_dir().iterdir():
        shutil.copy(f, folder / f.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<|endoftext|>", "special": True, "__type": "AddedToken"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", list(OWN_TEMPLATES))
def test_own_chat_templates_render_as_transformers_renders_them(tmp_path, own_tokenizer_dir, name):
    source = OWN_TEMPLATES[name]
    (tmp_path / "t.jinja").write_text(source)
    ours = find_chat_template(own_tokenizer_dir / "tokenizer.json", str(tmp_path / "t.jinja"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(own_tokenizer_dir)
    assert ours.end_of_turn == "<|im_end|>"
    for messages in [*ORACLE_CONVERSATIONS[:4], conv("q", "a", system=True)]:
        messages = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages if m["role"] != "tool"]
        for gen in (False, True):
            want = hf_tok.apply_chat_template(messages, tokenize=False, chat_template=source, add_generation_prompt=gen)
            assert "<|im_end|>" in want
            assert ours.render(messages, add_generation_prompt=gen) == want
        ids, labels = tokenize_conversation(ours, messages)
        assert ids == list(hf_tok.apply_chat_template(messages, chat_template=source, tokenize=True,
                                                      return_dict=True)["input_ids"])
        # every assistant turn ends with a learned <|im_end|>, from the tokenizer's eos_token
        learned = [ids[p] for p in trained_positions(labels)]
        assert learned.count(ours.token_id("<|im_end|>")) == sum(m["role"] == "assistant" for m in messages)


def test_printing_an_undefined_name_is_an_error_not_an_empty_string(tmp_path, own_tokenizer_dir):
    source = OWN_TEMPLATES["printed eos_token"].replace("{{- eos_token }}", "{{- end_of_turn }}{{- '<|im_end|>' }}")
    (tmp_path / "t.jinja").write_text(source)
    hf_tok = transformers.AutoTokenizer.from_pretrained(own_tokenizer_dir)
    assert "end_of_turn" not in hf_tok.apply_chat_template(conv("q", "a"), tokenize=False, chat_template=source)
    with pytest.raises(UserError, match="'end_of_turn' is undefined.*defines: bos_token, eos_token, pad_token"):
        find_chat_template(own_tokenizer_dir / "tokenizer.json", str(tmp_path / "t.jinja"))


def test_reasoning_fields_are_the_ones_transformers_renders():
    from transformers.utils.chat_template_utils import _REASONING_FIELDS

    from titanite.data.chat_template import REASONING_FIELDS
    assert REASONING_FIELDS == _REASONING_FIELDS


def test_own_templates_stay_in_transformers_sandbox(tmp_path, own_tokenizer_dir):
    source = OWN_TEMPLATES["printed eos_token"].replace("{{- eos_token }}", "{{- ''.__class__.__mro__ }}{{- eos_token }}")
    (tmp_path / "t.jinja").write_text(source)
    with pytest.raises(UserError, match="unsafe"):
        find_chat_template(own_tokenizer_dir / "tokenizer.json", str(tmp_path / "t.jinja"))


@pytest.mark.parametrize("row, what", [
    ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]},
                   {"role": "assistant", "content": "a cat"}]}, "'messages' message 0 has 'image' content"),
    ({"messages": conv("what is it?", "a cat"), "images": ["cat.png"]}, "a 'images' column"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": "x.mp4"}]},
                   {"role": "assistant", "content": "a film"}]}, "'video_url' content"),
])
@pytest.mark.parametrize("on_malformed", ["error", "skip"])
def test_image_and_video_inputs_stop_the_run_saying_text_only(tmp_path, row, what, on_malformed):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conv("hi", "hello")}, row])
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    with pytest.raises(UserError, match=r"chat\.jsonl:2: .*text only for now") as e:
        list(chat_samples(chat_cfg(path, on_malformed=on_malformed), tok, ChatStats()))
    assert what in str(e.value)


def test_preference_rows_with_images_are_refused_too():
    from titanite.data.chat import MediaInput
    from titanite.data.preference import check_row

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which?"}]}]
    answer = [{"role": "assistant", "content": "a"}]
    with pytest.raises(MediaInput, match="'prompt' message 0 has 'image' content"):
        check_row({"prompt": messages, "chosen": answer, "rejected": answer})
    with pytest.raises(MediaInput, match="'images' column"):
        check_row({"prompt": "which?", "chosen": "a", "rejected": "b", "images": ["x.png"]})
    assert check_row({"prompt": "which?", "chosen": "a", "rejected": "b", "images": []})["chosen"] == "a"

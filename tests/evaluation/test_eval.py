"""[eval]: held-out loss and perplexity every N steps and at the end, in metrics.jsonl.
Oracle: transformers on the run's final Hugging Face export, scoring the held-out data itself."""

from __future__ import annotations

import math

import pytest
import tokenizers
import torch
import torch.nn.functional as F
import transformers

from tests.conftest import make_hf_checkpoint, read_metrics, tiny_train_args
from tests.fixtures.chat import make_chat_tokenizer, toy_conversations, write_jsonl
from titanite.core.config import DataConfig, load_config
from titanite.core.errors import UserError
from titanite.data import load_tokenizer
from titanite.data.chat import IGNORE_INDEX, ChatStats, chat_samples
from titanite.run.trainer import Trainer

HELD_OUT = ["the optimizer reads small batches of data", "tokens predict the loss on every step",
            "training data and the model and the next token"] * 6


def train(args: list[str]) -> None:
    Trainer(load_config(None, args)).train()


def test_stream_eval_every_n_steps_matches_transformers(tmp_path, tiny_hf, tiny_data):
    eval_path = write_jsonl(tmp_path / "heldout.jsonl", [{"text": t} for t in HELD_OUT])
    out = tmp_path / "run"
    train(tiny_train_args(tiny_hf, tiny_data, out, steps=4, **{
        "eval.path": eval_path, "eval.interval": 2, "eval.batch_size": 4, "metrics.log_interval": 3}))
    rows = {r["step"]: r for r in read_metrics(out)}
    # Logged: steps 1 and 3 (log_interval), 2 and 4 (evaluation; 4 is also the last step).
    assert sorted(rows) == [1, 2, 3, 4]
    assert [s for s, r in rows.items() if "eval_loss" in r] == [2, 4]
    assert all("loss" in r and "grad_norm" in r for r in rows.values())

    # Oracle: tokenize the held-out texts directly, join with <|endoftext|>, cut 33-token windows.
    tok = tokenizers.Tokenizer.from_file(str(tiny_hf / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    stream = [i for t in HELD_OUT for i in tok.encode(t, add_special_tokens=False).ids + [eot]]
    n = len(stream) // 33
    windows = torch.tensor(stream[: n * 33]).view(n, 33)
    assert n % 4 != 0  # the last eval batch is a short one
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
    want = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    final = rows[4]
    assert final["eval_loss"] == pytest.approx(want, rel=1e-5)
    assert final["eval_ppl"] == pytest.approx(math.exp(want), rel=1e-5)
    assert final["eval_tokens"] == n * 32
    assert rows[2]["eval_loss"] != final["eval_loss"]  # the model changed in between


def test_chat_eval_is_token_weighted_over_samples_and_max_batches_limits_it(tmp_path):
    hf_dir = make_hf_checkpoint(tmp_path / "hf", make_chat_tokenizer(tmp_path / "tok"))
    train_path = write_jsonl(tmp_path / "train.jsonl", toy_conversations(2))
    eval_rows = toy_conversations(1)[::2]
    eval_path = write_jsonl(tmp_path / "eval.jsonl", eval_rows)
    common = {"data.format": "chat", "data.seq_len": 64, "data.packing": "pad", "eval.path": eval_path,
              "eval.batch_size": 3}
    full, limited = tmp_path / "full", tmp_path / "limited"
    train(tiny_train_args(hf_dir, train_path, full, steps=2, **common))
    train(tiny_train_args(hf_dir, train_path, limited, steps=2, **common, **{"eval.max_batches": 1}))

    tok = load_tokenizer("", str(hf_dir))
    cfg = DataConfig(path=str(eval_path), format="chat")
    samples = [(i.tolist(), label.tolist()) for i, label in chat_samples(cfg, tok, ChatStats())]
    assert len(samples) == len(eval_rows) == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(full / "hf", dtype=torch.float32).eval()
    sums, counts = [], []
    with torch.no_grad():
        for ids, labels in samples:
            logits = hf(torch.tensor([ids])).logits[0]
            sums.append(F.cross_entropy(logits, torch.tensor(labels), ignore_index=IGNORE_INDEX,
                                        reduction="sum").item())
            counts.append(sum(label != IGNORE_INDEX for label in labels))
    final = read_metrics(full)[-1]
    assert final["eval_loss"] == pytest.approx(sum(sums) / sum(counts), rel=1e-5)
    assert final["eval_tokens"] == sum(counts)
    # max_batches = 1: only the first batch of 3 samples ('pad' packing: one sample per sequence).
    first = read_metrics(limited)[-1]
    assert first["eval_tokens"] == sum(counts[:3])
    assert first["eval_loss"] == pytest.approx(sum(sums[:3]) / sum(counts[:3]), rel=1e-5)


def test_eval_config_and_data_errors_name_the_key(tmp_path, tiny_hf, tiny_data):
    with pytest.raises(UserError, match="eval.interval"):
        load_config(None, ["--eval.interval=-1"])
    with pytest.raises(UserError, match="unknown config key 'eval.pth'.*did you mean 'path'"):
        load_config(None, ["--eval.pth=x"])
    short = write_jsonl(tmp_path / "short.jsonl", [{"text": "too short"}])
    with pytest.raises(UserError, match="eval.path = .*short.jsonl.* fewer than data.seq_len"):
        Trainer(load_config(None, tiny_train_args(tiny_hf, tiny_data, tmp_path / "run", **{"eval.path": short})))

"""Weighted mixtures (data.sources) and streaming (data.streaming).

Mixtures: the draw follows the weights, is deterministic from the seed and independent of the
number of ranks, and resumes exactly. Streaming: the same windows as a prepared store read in
order, and exact resume from any point, across epochs. Both resume exactly in training.

Oracles: each source's own windows (every served row must be one of its source's), the token
store's windows, an uninterrupted loader / run, and one rank serving the whole global batch.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import corpus_texts, make_hf_checkpoint, read_metrics, stop_after, tiny_train_args
from titanite.core.config import DataConfig, load_config
from titanite.core.errors import UserError
from titanite.data.loader import make_loader
from titanite.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("mix")
    texts = corpus_texts(240)
    a, b = root / "web.jsonl", root / "code.txt"
    a.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:160]))
    b.mkdir()
    for i, t in enumerate(texts[160:]):
        (b / f"{i:03d}.txt").write_text(t.upper())
    return [{"path": str(a), "weight": 3.0}, {"path": str(b), "weight": 1.0, "name": "code"}]


def mixture(sources, tok, cache, batch_size=4, seed=0, rank=0, world_size=1, **kw):
    cfg = load_config(None, [f"--data.sources={_toml(sources)}", "--data.seq_len=16",
                             f"--data.cache_dir={cache}", *(f"--data.{k}={v}" for k, v in kw.items())]).data
    return make_loader(cfg, tok, batch_size, seed, rank, world_size)


def _toml(sources: list[dict]) -> str:
    return "[" + ", ".join("{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in s.items()) + "}" for s in sources) + "]"


def _rows_by_source(ld) -> dict[tuple, int]:
    out = {}
    for s, part in enumerate(ld.parts):
        ids = part.windows.batch(np.arange(len(part.windows)))["input_ids"].tolist()
        out.update({tuple(r): s for r in ids})
    return out


@pytest.mark.parametrize("packing", ["stream", "documents"])
def test_draw_follows_weights_and_the_seed(tmp_path, sources, tiny_tokenizer_dir, packing):
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    ld = mixture(sources, tok, tmp_path, packing=packing)
    owner = _rows_by_source(ld)
    served = [tuple(r) for _ in range(300) for r in ld.next_batch()["input_ids"].tolist()]
    shares = np.bincount([owner[r] for r in served], minlength=2) / len(served)  # every row is a source's window
    assert abs(shares[0] - 0.75) < 0.04, shares
    assert ld.data_metrics()["data/web/tokens"] > ld.data_metrics()["data/code/tokens"] > 0
    again = mixture(sources, tok, tmp_path, packing=packing)
    assert [tuple(r) for _ in range(20) for r in again.next_batch()["input_ids"].tolist()] == served[:80]
    other = mixture(sources, tok, tmp_path, packing=packing, seed=1)
    assert [tuple(r) for _ in range(20) for r in other.next_batch()["input_ids"].tolist()] != served[:80]
    # within its first epoch a source serves each of its windows at most once
    code = [r for r in served if owner[r] == 1][: ld.num_windows[1]]
    every = ld.parts[1].windows.batch(np.arange(ld.num_windows[1]))["input_ids"].tolist()
    assert Counter(code) <= Counter(map(tuple, every))


def test_ranks_split_the_same_global_order_and_resume_on_another_world_size(tmp_path, sources, tiny_tokenizer_dir):
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    one = mixture(sources, tok, tmp_path, batch_size=4)
    whole = [one.next_batch()["input_ids"].tolist() for _ in range(6)]
    two = [mixture(sources, tok, tmp_path, batch_size=2, rank=r, world_size=2) for r in range(2)]
    for step in range(3):
        assert two[0].next_batch()["input_ids"].tolist() + two[1].next_batch()["input_ids"].tolist() == whole[step]
    # rank 0's state after 3 steps of 2 ranks, resumed on one rank: the same next batches
    resumed = mixture(sources, tok, tmp_path, batch_size=4)
    resumed.load_state_dict(json.loads(json.dumps(two[0].state_dict())))
    assert [resumed.next_batch()["input_ids"].tolist() for _ in range(3)] == whole[3:]
    single = make_loader(DataConfig(path=sources[0]["path"], seq_len=16, cache_dir=str(tmp_path)), tok, 4, 0)
    with pytest.raises(UserError, match="mixture"):
        single.load_state_dict(two[0].state_dict())
    changed = mixture([sources[0], {**sources[1], "name": "other"}], tok, tmp_path)
    with pytest.raises(UserError, match="the mixture changed"):
        changed.load_state_dict(two[0].state_dict())


@pytest.mark.parametrize("mode", ["mixture", "streaming"])
def test_training_resumes_exactly(tmp_path, sources, tiny_tokenizer_dir, mode):
    from titanite.run.trainer import Trainer

    hf = make_hf_checkpoint(tmp_path / "hf", tiny_tokenizer_dir)
    if mode == "mixture":
        data = {"data.path": "", "data.sources": _toml(sources)}
    else:  # a short stream, so the run crosses into the second epoch
        data = {"data.path": sources[1]["path"], "data.streaming": True, "data.max_files": 1}
    args = lambda out: tiny_train_args(hf, "", out, steps=6, **{**data, "checkpoint.interval": 0})  # noqa: E731
    ref = Trainer(load_config(None, args(tmp_path / "ref")))
    ref.train()
    ref.close()
    head = stop_after(Trainer(load_config(None, args(tmp_path / "run"))), 3)
    rest = Trainer(load_config(None, args(tmp_path / "run")))
    rest.train()
    rest.close()
    want = read_metrics(tmp_path / "ref")
    assert head == [r["loss"] for r in want[:3]]
    got = read_metrics(tmp_path / "run")
    assert [r["loss"] for r in got[-3:]] == [r["loss"] for r in want[3:]]
    if mode == "mixture":
        assert got[-1]["data/web/tokens"] == want[-1]["data/web/tokens"] > got[-1]["data/code/tokens"] > 0
    else:
        assert want[-1]["data_epoch"] >= 1 and got[-1]["data_epoch"] == want[-1]["data_epoch"]


def _streams(path, tok, batch_size=4, rank=0, world_size=1, **kw):
    cfg = DataConfig(path=str(path), seq_len=16, streaming=True, **kw)
    return make_loader(cfg, tok, batch_size, 0, rank, world_size)


def test_streaming_serves_the_stores_windows_in_order(tmp_path, sources, tiny_tokenizer_dir):
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    stored = make_loader(DataConfig(path=sources[0]["path"], seq_len=16, shuffle=False, cache_dir=str(tmp_path)),
                         tok, 4, 0)
    n = stored.batches_per_epoch
    want = [stored.next_batch() for _ in range(n)]
    stream = _streams(sources[0]["path"], tok)
    halves = [_streams(sources[0]["path"], tok, batch_size=2, rank=r, world_size=2) for r in range(2)]
    for b in want:
        got = stream.next_batch()
        assert all(torch.equal(got[k], b[k]) for k in b)
        assert torch.equal(torch.cat([h.next_batch()["labels"] for h in halves]), b["labels"])


def test_streaming_resumes_exactly_from_any_point(tmp_path, sources, tiny_tokenizer_dir):
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    path = sources[1]["path"]
    ref = _streams(path, tok, max_files=4)
    batches, states = [], []
    for _ in range(30):  # several epochs of a 4-document stream
        states.append(json.loads(json.dumps(ref.state_dict())))
        batches.append(ref.next_batch()["input_ids"])
    assert ref.epoch >= 2 and any(s["offset"] for s in states)  # cut inside documents and across epochs
    for k in (1, 7, 13, 22):
        resumed = _streams(path, tok, max_files=4)
        resumed.load_state_dict(states[k])
        assert all(torch.equal(resumed.next_batch()["input_ids"], b) for b in batches[k:k + 5]), k
    with pytest.raises(UserError, match=r"is of a mixture \(data.sources\), but this run reads a stream"):
        _streams(path, tok).load_state_dict({"kind": "mixture", "seq_len": 16})


def test_a_missing_source_is_refused_before_any_work(tmp_path, sources, tiny_tokenizer_dir):
    from titanite.run.preflight import preflight

    hf = make_hf_checkpoint(tmp_path / "hf", tiny_tokenizer_dir)
    bad = [sources[0], {"path": str(tmp_path / "nope.jsonl"), "weight": 1.0}]
    args = tiny_train_args(hf, "", tmp_path / "out", **{"data.path": "", "data.sources": _toml(bad)})
    with pytest.raises(UserError, match=r"data.sources\[1\].path.*nope.jsonl"):
        preflight(load_config(None, args))
    assert not Path(tmp_path / "out").exists()
    for sources_, why in (([{"path": "a", "weight": 0}], r"weight' must be a finite number > 0, got 0"),
                          ([{"path": "a", "weight": -1.5}], r"weight' must be a finite number > 0, got -1.5"),
                          ([{"path": "a"}, {"path": "b", "weight": 1}], r"data.sources\[0\].weight' is missing"),
                          ([{"weight": 1}], r"data.sources\[0\].path' is missing")):
        with pytest.raises(UserError, match=why):
            load_config(None, ["--data.path=", f"--data.sources={_toml(sources_)}"])
    with pytest.raises(UserError, match="not both"):
        load_config(None, tiny_train_args(hf, sources[0]["path"], tmp_path / "out", **{"data.sources": _toml(sources)}))


def test_streaming_refuses_what_it_cannot_serve(tmp_path):
    for bad in (["--data.format=chat"], ["--data.packing=documents"]):
        with pytest.raises(UserError, match="data.streaming"):
            load_config(None, ["--data.path=x", "--data.streaming=true", *bad])


@pytest.mark.parametrize("mode", ["one source", "mixture", "streaming"])
def test_prefetch_serves_the_same_batches_and_the_position_of_those_taken(tmp_path, sources, tiny_tokenizer_dir, mode):
    from titanite.data.prefetch import Prefetcher

    tok = load_tokenizer(str(tiny_tokenizer_dir))

    def fresh():
        if mode == "mixture":
            return mixture(sources, tok, tmp_path)
        return make_loader(DataConfig(path=sources[0]["path"], seq_len=16, cache_dir=str(tmp_path),
                                      streaming=mode == "streaming"), tok, 4, 0)

    plain, ahead = fresh(), Prefetcher(fresh(), depth=3)
    for _ in range(5):
        want, got = plain.next_batch(), ahead.next_batch()
        assert all(torch.equal(want[k], got[k]) for k in want)
        deadline = time.monotonic() + 10
        while not ahead._queue.full() and time.monotonic() < deadline:  # let the thread run 3 batches ahead
            time.sleep(0.01)
        assert ahead._queue.full()
        assert ahead.state_dict() == plain.state_dict()  # not the position of the batches made ahead
        metrics = ahead.data_metrics()
        assert {k: metrics[k] for k in plain.data_metrics()} == plain.data_metrics()
    assert metrics["data_loader_tokens_per_sec"] > 0 and metrics["data_wait_s"] >= 0
    ahead.close()
    # An error in the loader surfaces in the training loop...
    broken = Prefetcher(fresh())
    broken.loader.next_batch = lambda: (_ for _ in ()).throw(UserError("the data went away"))
    with pytest.raises(UserError, match="went away"):
        broken.next_batch()
    # ...and one met while the queue is full never holds up closing.
    stuck = Prefetcher(fresh(), depth=1)
    real, calls = stuck.loader.next_batch, []

    def second_fails():
        calls.append(1)
        if len(calls) > 2:
            raise UserError("late failure")
        return real()

    stuck.loader.next_batch = second_fails
    stuck.next_batch()
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    stuck.close()
    assert time.monotonic() - start < 2 and not stuck._thread.is_alive()


def test_evaluation_of_a_chat_mixture_reads_chat(tmp_path, tiny_tokenizer_dir):
    from tests.fixtures.chat import make_chat_tokenizer, toy_conversations, write_jsonl
    from titanite.evaluation.heldout import Evaluator

    tok_dir = make_chat_tokenizer(tmp_path / "tok")
    chat = write_jsonl(tmp_path / "chat.jsonl", toy_conversations(4))
    cfg = load_config(None, ["--data.path=", f"--data.sources={_toml([{'path': str(chat), 'weight': 1.0, 'format': 'chat'}])}",
                             f"--data.tokenizer={tok_dir}", "--data.seq_len=64", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--eval.path={chat}"])
    ev = Evaluator(cfg, load_tokenizer(str(tok_dir)))
    batch = ev.windows.batch(np.arange(len(ev.windows)))
    assert "document_ids" in batch and (batch["labels"] != -100).sum() < (batch["input_ids"] != 0).sum()

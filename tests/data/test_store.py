"""The token store: tokenize once (serially or in worker processes, the same bytes), read lazily,
cached by source and tokenizer, and refused when stale, damaged or made with another tokenizer.

Oracles: the `tokenizers` library's own encoding of documents written by the test,
`tokenize_conversation` for chat rows (itself checked against transformers in test_chat.py), and
a greedy packer written here for the 'documents' layout.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from tests.conftest import REPO, corpus_texts, make_hf_checkpoint, run_cli, tiny_train_args
from tests.fixtures.chat import make_chat_tokenizer, toy_conversations, write_jsonl
from titanite.core.config import DataConfig
from titanite.core.errors import UserError
from titanite.data import PackedLoader, load_tokenizer, store
from titanite.data import prepare as prep
from titanite.data.chat import IGNORE_INDEX, load_chat_template, tokenize_conversation
from titanite.data.packing import StreamWindows

DOCS = corpus_texts(120)


def _write_source(kind: str, folder: Path) -> tuple[DataConfig, list]:
    """The test's documents (or chat rows) in one source format, and the [data] reading them."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "txt folder":
        for i, d in enumerate(DOCS):
            (folder / f"{i:04d}.txt").write_text(d)
        return DataConfig(path=str(folder)), DOCS
    if kind == "jsonl":
        path = folder / "d.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
        return DataConfig(path=str(path)), DOCS
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS}), folder / "d.parquet", row_group_size=17)
        return DataConfig(path=str(folder / "d.parquet")), DOCS
    if kind == "datasets folder":
        import datasets

        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(folder / "ds"))
        return DataConfig(path=str(folder / "ds")), DOCS
    assert kind == "chat", kind
    rows = toy_conversations(3)
    return DataConfig(path=str(write_jsonl(folder / "chat.jsonl", rows)), format="chat"), rows


def _expected_samples(kind: str, items: list, tok) -> list[tuple[list[int], list[int] | None]]:
    if kind == "chat":
        template = load_chat_template(DataConfig(format="chat"), tok)
        return [tuple(tokenize_conversation(template, r["messages"])) for r in items]
    raw = tokenizers.Tokenizer.from_file(str(tok.path))
    return [(raw.encode(d, add_special_tokens=False).ids + [tok.eos_id], None) for d in items]


@pytest.fixture(scope="module")
def chat_tok_dir(tmp_path_factory) -> Path:
    return make_chat_tokenizer(tmp_path_factory.mktemp("chat-tok"))


@pytest.mark.parametrize("kind", ["txt folder", "jsonl", "parquet", "datasets folder", "chat"])
def test_prepare_each_source_type_serially_and_in_parallel(tmp_path, chat_tok_dir, kind, monkeypatch):
    # small chunks, so the workers' results really are put back in order
    monkeypatch.setattr(prep, "_CHUNK_DOCS", 7)
    monkeypatch.setattr(prep, "_CHUNK_ROWS", 5)
    cfg, items = _write_source(kind, tmp_path / "src")
    tok = load_tokenizer(str(chat_tok_dir))
    serial = prep.prepare(cfg, tok, tmp_path / "serial", workers=1)
    want = _expected_samples(kind, items, tok)
    assert serial.num_samples == len(want)
    for i, (ids, labels) in enumerate(want):
        got_ids, got_labels = serial.sample(i)
        assert got_ids.tolist() == ids
        if labels is not None:
            assert got_labels.tolist() == labels
    assert serial.max_id == max(max(ids) for ids, _ in want)
    parallel = prep.prepare(cfg, tok, tmp_path / "parallel", workers=2)  # worker processes: the same bytes
    for name in serial.manifest["files"]:
        assert (tmp_path / "serial" / name).read_bytes() == (tmp_path / "parallel" / name).read_bytes(), name
    assert parallel.manifest["files"] == serial.manifest["files"]
    assert not list(tmp_path.glob("*.tmp-*"))


def _greedy_windows(samples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int):
    """The 'documents' layout, written out plainly: whole samples in order, a new window when
    the next one does not fit, samples cut to seq_len."""
    windows, current = [], []
    for ids, labels in samples:
        ids, labels = ids[:seq_len], labels[:seq_len]
        if current and sum(len(i) for i, _ in current) + len(ids) > seq_len:
            windows.append(current)
            current = []
        current.append((ids, labels))
    windows.append(current)
    out = []
    for w in windows:
        ids = [t for i, _ in w for t in i]
        labels = [t for _, lab in w for t in lab]
        pos = [p for i, _ in w for p in range(len(i))]
        doc = [k for k, (i, _) in enumerate(w) for _ in i]
        pad = seq_len - len(ids)
        out.append((ids + [pad_id] * pad, labels + [IGNORE_INDEX] * pad, pos + list(range(pad)), doc + [len(w)] * pad))
    return out


@pytest.mark.parametrize("packing", ["stream", "documents"])
def test_training_reads_the_windows_of_the_stored_tokens(tmp_path, chat_tok_dir, packing):
    cfg, items = _write_source("jsonl", tmp_path / "src")
    tok = load_tokenizer(str(chat_tok_dir))
    seq_len = 24
    ld = PackedLoader(DataConfig(path=cfg.path, seq_len=seq_len, packing=packing,
                                 cache_dir=str(tmp_path / "cache")), tok, 2, 0)
    got = ld.windows.batch(np.arange(len(ld.windows)))
    samples = _expected_samples("jsonl", items, tok)
    if packing == "stream":
        stream = [t for ids, _ in samples for t in ids]
        n = len(stream) // (seq_len + 1)
        want = np.asarray(stream[: n * (seq_len + 1)]).reshape(n, seq_len + 1)
        assert got["input_ids"].tolist() == want[:, :-1].tolist()
        assert got["labels"].tolist() == want[:, 1:].tolist()
    else:
        with_labels = [(ids, ids[1:] + [IGNORE_INDEX]) for ids, _ in samples]
        want = _greedy_windows(with_labels, seq_len, tok.eos_id)
        assert len(ld.windows) == len(want)
        for key, col in zip(("input_ids", "labels", "position_ids", "document_ids"), zip(*want)):
            assert got[key].tolist() == [list(c) for c in col], key
    # Opening the store maps its files: nothing of the corpus is read into memory up front.
    assert isinstance(ld.store.tokens, np.memmap)


def test_cache_reuses_a_store_and_a_changed_source_gets_a_new_one(tmp_path, chat_tok_dir, caplog):
    cfg, _ = _write_source("jsonl", tmp_path / "src")
    cfg = DataConfig(path=cfg.path, cache_dir=str(tmp_path / "cache"))
    tok = load_tokenizer(str(chat_tok_dir))
    with caplog.at_level(logging.INFO, logger="titanite"):
        first = prep.obtain(cfg, tok)
        assert "preparing the token store" in caplog.text
        caplog.clear()
        again = prep.obtain(cfg, tok)
        assert "preparing" not in caplog.text and again.path == first.path
        with open(cfg.path, "a") as f:
            f.write(json.dumps({"text": "one more document"}) + "\n")
        changed = prep.obtain(cfg, tok)
    assert changed.path != first.path and changed.num_samples == first.num_samples + 1
    # A damaged cached store is prepared again, not read.
    with open(changed.path / "tokens.bin", "r+b") as f:
        f.truncate(8)
    with caplog.at_level(logging.WARNING, logger="titanite"):
        repaired = prep.obtain(cfg, tok)
    assert "unusable" in caplog.text and repaired.num_tokens == changed.num_tokens


def test_ranks_share_one_prepare(tmp_path, chat_tok_dir):
    """Two processes asking for the same store at once: one prepares, the other waits and opens it."""
    cfg, _ = _write_source("jsonl", tmp_path / "src")
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
            "from titanite.core.config import DataConfig; from titanite.data import load_tokenizer, prepare as prep; "
            f"prep.obtain(DataConfig(path={cfg.path!r}, cache_dir={str(tmp_path / 'cache')!r}), "
            f"load_tokenizer({str(chat_tok_dir)!r}))")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    assert sum("preparing the token store" in log for log in logs) == 1, logs
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 1


def test_an_unfinished_store_is_never_taken_for_a_complete_one(tmp_path, chat_tok_dir):
    cfg, _ = _write_source("jsonl", tmp_path / "src")
    tok = load_tokenizer(str(chat_tok_dir))
    out = tmp_path / "store"
    killed = tmp_path / "store.tmp-4242"  # what a prepare killed half-way leaves
    killed.mkdir()
    (killed / "tokens.bin").write_bytes(b"\0" * 64)
    with pytest.raises(UserError, match="not a complete token store"):
        store.open_store(killed)
    (killed / "manifest.json").write_text(json.dumps({"format": store.FORMAT, "version": store.VERSION}))
    with pytest.raises(UserError, match="an incomplete token store manifest"):
        store.open_store(killed)
    made = prep.prepare(cfg, tok, out)
    assert not killed.exists() and made.num_samples == len(DOCS)
    # An error in the data leaves no folder behind.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(UserError, match="holds int"):
        prep.prepare(DataConfig(path=str(bad)), tok, tmp_path / "bad-store")
    assert not list(tmp_path.glob("bad-store*"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "  "}\n')
    with pytest.raises(UserError, match="holds no documents"):
        prep.prepare(DataConfig(path=str(empty)), tok, tmp_path / "empty-store")
    assert not list(tmp_path.glob("empty-store*"))


def test_prepare_command_then_train_on_the_named_store(tmp_path, chat_tok_dir):
    """`titanite data prepare --out DIR`, then data.path = DIR: trains; the same store with its
    source changed, with another tokenizer, or damaged, stops with exit 2 before any work."""
    hf = make_hf_checkpoint(tmp_path / "hf", chat_tok_dir)
    cfg, _ = _write_source("jsonl", tmp_path / "src")
    src = Path(cfg.path)
    config = tmp_path / "run.toml"
    config.write_text(f'[data]\npath = "{src}"\ntokenizer = "{chat_tok_dir}"\n')
    prepared = tmp_path / "prepared"
    proc = run_cli("data", "prepare", "--config", str(config), "--out", str(prepared), "--workers", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"data.path: {prepared} ({len(DOCS)} samples" in proc.stdout
    assert run_cli("data", "verify", str(prepared)).returncode == 0

    def train(out: Path, **extra) -> subprocess.CompletedProcess:
        args = tiny_train_args(hf, prepared, out, steps=2, **{"data.tokenizer": chat_tok_dir, **extra})
        return run_cli("train", *args)

    ok = train(tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr[-3000:]
    other_tok = tmp_path / "other-tok"
    other_tok.mkdir()
    (other_tok / "tokenizer.json").write_bytes((chat_tok_dir / "tokenizer.json").read_bytes().replace(b'"alpha"', b'"alphx"'))
    proc = train(tmp_path / "refused", **{"data.tokenizer": other_tok})
    assert proc.returncode == 2 and "another tokenizer" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "refused").exists()
    src.write_text(src.read_text() + json.dumps({"text": "changed"}) + "\n")
    proc = train(tmp_path / "stale")
    assert proc.returncode == 2 and "is stale" in proc.stderr and str(src) in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "stale").exists()
    # flipped bytes: verify says so; a truncated file is caught on open
    data = bytearray((prepared / "tokens.bin").read_bytes())
    data[100] ^= 0xFF
    (prepared / "tokens.bin").write_bytes(bytes(data))
    proc = run_cli("data", "verify", str(prepared))
    assert proc.returncode == 2 and "SHA-256 differs" in proc.stderr
    # ...and training stops at the first window that reads an id the store never held
    data[400:404] = (2**31 - 1).to_bytes(4, "little")
    (prepared / "tokens.bin").write_bytes(bytes(data))
    damaged = store.open_store(prepared)
    windows = StreamWindows(damaged.tokens, 8, damaged)
    with pytest.raises(UserError, match=r"holds id 2147483647, outside \[0, "):
        windows.batch(np.arange(len(windows)))
    (prepared / "tokens.bin").write_bytes(bytes(data[:-4]))
    with pytest.raises(UserError, match="tokens.bin: .* bytes on disk, the manifest says"):
        store.open_store(prepared)


def test_a_named_store_with_ids_beyond_the_vocabulary_is_refused(tmp_path, chat_tok_dir):
    from titanite.core.config import load_config
    from titanite.run.preflight import preflight

    cfg, _ = _write_source("jsonl", tmp_path / "src")
    tok = load_tokenizer(str(chat_tok_dir))
    made = prep.prepare(cfg, tok, tmp_path / "prepared")
    # The run's own tokenizer fits the model; the store it names was made with a larger one.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    small_tok = Tokenizer(models.BPE())
    small_tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    small_tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "small-tok").mkdir()
    small_tok.save(str(tmp_path / "small-tok" / "tokenizer.json"))
    assert small_tok.get_vocab_size() <= made.max_id
    small = make_hf_checkpoint(tmp_path / "hf", None, vocab_size=made.max_id)
    args = tiny_train_args(small, tmp_path / "prepared", tmp_path / "out",
                           **{"data.tokenizer": tmp_path / "small-tok"})
    with pytest.raises(UserError, match=f"holds ids up to {made.max_id}, but the model's vocab_size is {made.max_id}"):
        preflight(load_config(None, args))
    assert not (tmp_path / "out").exists()


def test_prepare_never_replaces_what_is_not_a_store(tmp_path, chat_tok_dir):
    cfg, _ = _write_source("txt folder", tmp_path / "src")
    tok = load_tokenizer(str(chat_tok_dir))
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="exists and is not a token store"):
        prep.prepare(cfg, tok, precious)
    assert (precious / "notes.txt").read_text() == "keep me"
    for inside in (tmp_path / "src", tmp_path / "src" / "store"):
        with pytest.raises(UserError, match="holds or lies inside the data"):
            prep.prepare(cfg, tok, inside)
    assert len(list((tmp_path / "src").iterdir())) == len(DOCS)
    made = prep.prepare(cfg, tok, tmp_path / "out")
    assert prep.prepare(cfg, tok, tmp_path / "out").manifest["files"] == made.manifest["files"]  # over a store: fine


def test_a_named_store_must_have_the_runs_settings(tmp_path, chat_tok_dir):
    cfg, _ = _write_source("chat", tmp_path / "src")
    tok = load_tokenizer(str(chat_tok_dir))
    prep.prepare(DataConfig(path=cfg.path, format="chat", chat_loss="all"), tok, tmp_path / "all")
    with pytest.raises(UserError, match="data.chat_loss: .* prepared with data.chat_loss = 'all', and this run sets 'assistant'"):
        PackedLoader(DataConfig(path=str(tmp_path / "all"), format="chat", seq_len=64), tok, 1, 0)


def test_chat_prepare_in_workers_names_a_missing_template(tmp_path, tiny_tokenizer_dir):
    cfg, _ = _write_source("chat", tmp_path / "src")
    tok = load_tokenizer(str(tiny_tokenizer_dir))  # no chat template
    with pytest.raises(UserError, match="needs a chat template"):
        prep.prepare(cfg, tok, tmp_path / "store", workers=2)
    assert not list(tmp_path.glob("store*"))


def test_a_document_of_the_separator_alone_has_no_loss(tmp_path, chat_tok_dir):
    """A document the tokenizer turns into no ids is its separator alone: no token to learn, so
    'pad' packing leaves it out (counted), as before the store."""
    from tokenizers import Tokenizer, normalizers

    raw = Tokenizer.from_file(str(chat_tok_dir / "tokenizer.json"))
    raw.normalizer = normalizers.Replace("§", "")
    (tmp_path / "tok").mkdir()
    raw.save(str(tmp_path / "tok" / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tok"))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["first document", "§", "third document"]))
    ld = PackedLoader(DataConfig(path=str(path), packing="pad", seq_len=16, cache_dir=str(tmp_path / "c")), tok, 1, 0)
    assert ld.store.sample_lengths().tolist()[1] == 1
    assert (ld.sample_stats.samples, ld.sample_stats.dropped_no_loss) == (2, 1)
    assert all((ld.windows.batch(np.array([w]))["labels"] != IGNORE_INDEX).any() for w in range(len(ld.windows)))


def test_a_damaged_label_is_caught_when_read(tmp_path, chat_tok_dir):
    cfg, _ = _write_source("chat", tmp_path / "src")
    made = prep.prepare(cfg, load_tokenizer(str(chat_tok_dir)), tmp_path / "store")
    learned = int(np.flatnonzero(np.asarray(made.labels) != IGNORE_INDEX)[0])
    data = bytearray((tmp_path / "store" / "labels.bin").read_bytes())
    data[4 * learned:4 * learned + 4] = (2**31 - 1).to_bytes(4, "little")
    (tmp_path / "store" / "labels.bin").write_bytes(bytes(data))
    with pytest.raises(UserError, match="labels holds id 2147483647"):
        store.open_store(tmp_path / "store").sample(int(np.searchsorted(made.offsets, learned, side="right") - 1))

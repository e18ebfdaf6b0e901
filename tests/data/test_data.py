"""titanite.data: tokenizer loading, document sources, packing and the stateful loader.

Oracles: the `tokenizers` library's own encoding of the joined documents, files read back
independently, and uninterrupted / single-rank loaders for resume and sharding.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import pytest
import torch

from titanite.core.config import DataConfig
from titanite.core.errors import UserError
from titanite.data import PackedLoader, SourceStats, iter_documents, load_tokenizer

WORDS = "alpha beta gamma delta tensor kernel shard rank epoch token window loss".split()


def docs(n: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for i in range(n)]


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("qwen3")


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs()))
    return path


def loader(path, tok, batch_size=2, seed=0, rank=0, world_size=1, **cfg) -> PackedLoader:
    cfg.setdefault("seq_len", 16)
    return PackedLoader(DataConfig(path=str(path), **cfg), tok, batch_size, seed, rank, world_size)


def take(ld: PackedLoader, n: int) -> list[dict]:
    return [ld.next_batch() for _ in range(n)]


# --- tokenizer ---------------------------------------------------------------------------

def test_qwen3_tokenizer(qwen3):
    import tokenizers

    assert qwen3.vocab_size == 151669
    assert qwen3.eos_id == 151643  # <|endoftext|>, not the chat eos <|im_end|> of tokenizer_config
    assert {f.name for f in qwen3.files} >= {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"}
    raw = tokenizers.Tokenizer.from_file(str(qwen3.path))
    text = "def f(x):\n    return x + 1  # héllo"
    assert qwen3.encode_batch([text]) == [raw.encode(text, add_special_tokens=False).ids]
    assert qwen3.decode(qwen3.encode_batch([text])[0]) == text
    # A literal separator inside a document is text, not a document boundary.
    assert qwen3.eos_id not in qwen3.encode_batch(["a<|endoftext|>b"])[0]


def test_tokenizer_folder_file_and_hf_path(tiny_tokenizer_dir):
    for tok in (load_tokenizer(str(tiny_tokenizer_dir)), load_tokenizer(str(tiny_tokenizer_dir / "tokenizer.json")),
                load_tokenizer("", hf_path=str(tiny_tokenizer_dir))):
        assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
        assert [f.name for f in tok.files] == ["tokenizer.json", "tokenizer_config.json"]


def test_tokenizer_eos_from_config_and_errors(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "</s>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match="no document separator") as e:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path / "tokenizer.json") in str(e.value)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert load_tokenizer(str(tmp_path)).eos_id == 2

    with pytest.raises(UserError, match="data.tokenizer"):
        load_tokenizer("", "")
    with pytest.raises(UserError, match=r"data\.tokenizer.*not found.*nope"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match=r"data\.tokenizer.*cannot parse.*bad"):
        load_tokenizer(str(tmp_path / "bad"))


# --- sources -----------------------------------------------------------------------------

def read(**cfg) -> tuple[list[str], SourceStats]:
    stats = SourceStats()
    return list(iter_documents(DataConfig(**cfg), stats)), stats


def test_txt_folder_sorted_glob_and_max_files(tmp_path):
    for name, text in {"b.txt": "second", "a.txt": "first", "sub/c.txt": "third", "blank.txt": " \n\t",
                       "notes.md": "markdown"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    got, stats = read(path=str(tmp_path))
    assert got == ["first", "second", "third"]  # sorted by path; blank.txt skipped
    assert (stats.files, stats.documents, stats.empty_skipped) == (4, 3, 1)
    assert read(path=str(tmp_path), max_files=2)[0] == ["first", "second"]  # a.txt, b.txt
    assert read(path=str(tmp_path), glob="*.md")[0] == ["markdown"]
    assert read(path=str(tmp_path / "b.txt"))[0] == ["second"]
    with pytest.raises(UserError, match=r"no files matching \*\*/\*\.csv"):
        read(path=str(tmp_path), glob="**/*.csv")


def test_jsonl(tmp_path, jsonl):
    assert read(path=str(jsonl))[0] == docs()
    p = tmp_path / "x.jsonl"
    p.write_text('{"body": "one"}\n\n{"body": null}\n{"body": "two"}\n')
    got, stats = read(path=str(p), text_field="body")
    assert got == ["one", "two"] and stats.empty_skipped == 1
    with pytest.raises(UserError, match=r"x\.jsonl:1: no field 'text' \(data.text_field\)"):
        read(path=str(p))
    p.write_text('{"text": "ok"}\n{"text": "ok"}\n{oops\n')
    with pytest.raises(UserError, match=r"x\.jsonl:3: not valid JSON"):
        read(path=str(p))


def test_parquet_file_and_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": ["p1", None, "p2"], "id": [1, 2, 3]}), tmp_path / "pq" / "a.parquet")
    pq.write_table(pa.table({"text": ["p3"], "id": [4]}), tmp_path / "pq" / "b.parquet")
    got, stats = read(path=str(tmp_path / "pq"))
    assert got == ["p1", "p2", "p3"] and (stats.files, stats.empty_skipped) == (2, 1)
    assert read(path=str(tmp_path / "pq" / "b.parquet"))[0] == ["p3"]
    with pytest.raises(UserError, match=r"a\.parquet: no column 'body'.*\['text', 'id'\]"):
        read(path=str(tmp_path / "pq"), text_field="body")


def test_saved_datasets_folder(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["d1", "", "d2"], "n": [1, 2, 3]})
    ds.save_to_disk(str(tmp_path / "one"))
    assert read(path=str(tmp_path / "one"))[0] == ["d1", "d2"]
    datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_dict({"text": ["t1"]})}).save_to_disk(
        str(tmp_path / "dict"))
    assert read(path=str(tmp_path / "dict"), split="test", format="dataset")[0] == ["t1"]
    with pytest.raises(UserError, match=r"data.split = 'valid'.*\['train', 'test'\]"):
        read(path=str(tmp_path / "dict"), split="valid")
    with pytest.raises(UserError, match=r"no column 'body'.*\['text', 'n'\]"):
        read(path=str(tmp_path / "one"), text_field="body")
    with pytest.raises(UserError, match="not a datasets save_to_disk folder"):
        read(path=str(tmp_path), format="dataset")


def test_hub_dataset_uses_name_and_split(monkeypatch):
    import datasets

    calls = []

    def fake_load(name, split, streaming=False):
        calls.append((name, split, streaming))
        ds = datasets.Dataset.from_dict({"text": ["h1", "h2"]})
        return ds.to_iterable_dataset() if streaming else ds

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert read(dataset_name="org/corpus", split="validation")[0] == ["h1", "h2"]
    # data.streaming reads the hub dataset in datasets' streaming mode
    assert read(dataset_name="org/corpus", split="validation", streaming=True)[0] == ["h1", "h2"]
    assert calls == [("org/corpus", "validation", False), ("org/corpus", "validation", True)]
    with pytest.raises(UserError, match="only one of data.path"):
        read(dataset_name="org/corpus", path="x")


def test_stdlib_source():
    root = Path(sysconfig.get_paths()["stdlib"])
    expected = sorted((p for p in root.glob("**/*.py") if "site-packages" not in p.relative_to(root).parts),
                      key=lambda p: p.relative_to(root).as_posix())[:4]
    want = [t for t in (p.read_text(encoding="utf-8") for p in expected) if t.strip()]
    got, stats = read(path="<stdlib>", max_files=4)
    assert got == want and stats.files == 4


def test_undecodable_bytes_policies(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"ok \xff\xfe bad")
    (tmp_path / "b.txt").write_text("fine")
    with pytest.raises(UserError, match=r"a\.txt: not valid UTF-8 at byte offset 3.*data.on_decode_error"):
        read(path=str(tmp_path))
    got, stats = read(path=str(tmp_path), on_decode_error="skip")
    assert got == ["fine"] and (stats.files, stats.undecodable_skipped) == (1, 1)
    got, _ = read(path=str(tmp_path), on_decode_error="replace")
    assert got == ["ok \ufffd\ufffd bad", "fine"]


def test_missing_path_and_nothing_configured(tmp_path):
    with pytest.raises(UserError, match=r"data\.path: .*nowhere does not exist"):
        read(path=str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="data.path"):
        read()


# --- packing and loader --------------------------------------------------------------------

def test_windows_are_the_tokenizers_own_encoding(qwen3, jsonl):
    import tokenizers

    ld = loader(jsonl, qwen3, batch_size=1, shuffle=False)
    batches = take(ld, ld.batches_per_epoch)
    got = torch.cat([torch.cat([b["input_ids"][0], b["labels"][0, -1:]]) for b in batches])
    # Oracle: the raw library parses the separator in the joined text as one special token.
    raw = tokenizers.Tokenizer.from_file(str(qwen3.path))
    want = raw.encode("".join(d + "<|endoftext|>" for d in docs()), add_special_tokens=False).ids
    assert len(want) == ld.num_tokens and len(got) == ld.num_windows * 17
    assert got.tolist() == want[: len(got)]
    for b in batches:
        assert b["input_ids"].dtype == b["labels"].dtype == torch.int64
        assert b["input_ids"].shape == b["labels"].shape == b["position_ids"].shape == (1, 16)
        assert torch.equal(b["labels"][:, :-1], b["input_ids"][:, 1:])
        assert torch.equal(b["position_ids"][0], torch.arange(16))


def test_shuffle_is_seeded_and_each_epoch_is_a_permutation(qwen3, jsonl):
    a, b, c = (loader(jsonl, qwen3, batch_size=1, seed=s) for s in (7, 7, 8))
    n = a.batches_per_epoch
    ea, eb, ec = take(a, 2 * n), take(b, 2 * n), take(c, n)
    rows = lambda bs: [tuple(x["input_ids"][0].tolist()) for x in bs]  # noqa: E731
    assert rows(ea) == rows(eb)
    assert rows(ea[:n]) != rows(ec)
    seq = rows(take(loader(jsonl, qwen3, batch_size=1, shuffle=False), n))
    assert sorted(rows(ea[:n])) == sorted(seq) == sorted(rows(ea[n:]))
    assert rows(ea[:n]) != rows(ea[n:]) and rows(ea[:n]) != seq  # epochs differ; shuffled
    assert a.epoch == 1


@pytest.mark.parametrize("where", ["mid-epoch", "epoch-end", "second-epoch"])
def test_resume_matches_uninterrupted(qwen3, jsonl, where):
    full = loader(jsonl, qwen3, batch_size=3, seed=1)
    n = full.batches_per_epoch
    k = {"mid-epoch": 3, "epoch-end": n - 1, "second-epoch": n + 3}[where]  # epoch-end: next 5 roll over
    first = loader(jsonl, qwen3, batch_size=3, seed=1)
    take(first, k)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader(jsonl, qwen3, batch_size=3, seed=1)
    resumed.load_state_dict(state)
    want = take(full, k + 5)[k:]
    for w, g in zip(want, take(resumed, 5)):
        assert torch.equal(w["input_ids"], g["input_ids"]) and torch.equal(w["labels"], g["labels"])


def test_ranks_split_each_global_batch(qwen3, jsonl):
    r0, r1 = (loader(jsonl, qwen3, batch_size=2, rank=r, world_size=2) for r in (0, 1))
    one = loader(jsonl, qwen3, batch_size=4)
    for _ in range(one.batches_per_epoch + 2):  # across an epoch boundary
        a, b, g = r0.next_batch(), r1.next_batch(), one.next_batch()
        assert torch.equal(torch.cat([a["input_ids"], b["input_ids"]]), g["input_ids"])
        assert not {tuple(x) for x in a["input_ids"].tolist()} & {tuple(x) for x in b["input_ids"].tolist()}


def test_resume_two_ranks_on_one(qwen3, jsonl):
    ranks = [loader(jsonl, qwen3, batch_size=2, rank=r, world_size=2) for r in (0, 1)]
    for ld in ranks:
        take(ld, 5)
    one = loader(jsonl, qwen3, batch_size=4)
    one.load_state_dict(ranks[0].state_dict())
    for _ in range(3):
        want = torch.cat([ld.next_batch()["input_ids"] for ld in ranks])
        assert torch.equal(one.next_batch()["input_ids"], want)
    # Same samples when the global batch itself changes (2 -> 4 sequences per step).
    small, big = loader(jsonl, qwen3, batch_size=2), loader(jsonl, qwen3, batch_size=4)
    want = torch.cat([b["input_ids"] for b in take(small, 8)[6:]])
    big.load_state_dict(loader(jsonl, qwen3, batch_size=2).state_dict() | {"position": 6})
    assert torch.equal(big.next_batch()["input_ids"], want)
    odd = loader(jsonl, qwen3, batch_size=3)
    with pytest.raises(UserError, match="not a whole number of global batches"):
        odd.load_state_dict(ranks[0].state_dict())


def test_resume_on_changed_data_is_refused(qwen3, jsonl, tmp_path):
    state = loader(jsonl, qwen3).state_dict()
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs(40)))
    with pytest.raises(UserError, match="data changed since the checkpoint"):
        loader(other, qwen3).load_state_dict(state)
    with pytest.raises(UserError, match="data.seq_len is 8"):
        loader(jsonl, qwen3, seq_len=8).load_state_dict(state)


def test_too_little_data_and_empty_data(qwen3, tmp_path, caplog):
    (tmp_path / "small.txt").write_text("tiny")  # 'tiny' + separator: a few tokens
    with pytest.raises(UserError, match=r"has \d tokens, but one global batch needs 136") as e:
        loader(tmp_path / "small.txt", qwen3, batch_size=4, world_size=2, seq_len=16)
    assert "small.txt" in str(e.value)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("  \n")
    with pytest.raises(UserError, match=r"data.path = .*blank.* holds no documents"):
        loader(tmp_path / "blank", qwen3)
    with caplog.at_level("INFO", logger="titanite"):
        loader(tmp_path / "small.txt", qwen3, seq_len=1, batch_size=1)
    assert "1 files, 1 documents" in caplog.text

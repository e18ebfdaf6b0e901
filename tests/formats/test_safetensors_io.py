"""HF folder read/write, checked against transformers: its state_dict, its save_pretrained
files and its from_pretrained logits are the oracles."""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from titanite.core.errors import UserError
from titanite.formats import safetensors_io
from titanite.formats.safetensors_io import HFReader, read_hf_config, write_hf_folder

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _model(tied: bool) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**TINY, tie_word_embeddings=tied)
    return transformers.Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{(tied, sharded): (model, folder)} saved by transformers itself."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for tied in (False, True):
        model = _model(tied)
        for sharded in (False, True):
            folder = root / f"tied{int(tied)}-sharded{int(sharded)}"
            kwargs = {"max_shard_size": "20KB"} if sharded else {}
            model.save_pretrained(folder, **kwargs)
            out[tied, sharded] = model, folder
    return out


@pytest.fixture
def copy_of(ckpts, tmp_path):
    """A writable copy of one checkpoint, for corrupting."""
    def make(tied=False, sharded=False) -> Path:
        dst = tmp_path / "copy"
        shutil.copytree(ckpts[tied, sharded][1], dst)
        return dst
    return make


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.arange(24).reshape(2, 12) % TINY["vocab_size"]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("sharded", [False, True])
def test_reader_matches_state_dict(ckpts, tied, sharded):
    model, folder = ckpts[tied, sharded]
    sd = model.state_dict()
    with HFReader(folder) as r:
        assert (folder / "model.safetensors.index.json").exists() == sharded
        assert r.config == json.loads((folder / "config.json").read_text())
        # transformers drops the tied lm_head from the file; everything else is there.
        assert set(r.keys()) == set(sd) - ({"lm_head.weight"} if tied else set())
        for key in r.keys():
            assert key in r
            assert r.shape(key) == tuple(sd[key].shape)
            assert r.dtype(key) == sd[key].dtype
            assert r.file_of(key).parent == folder
            assert torch.equal(r.get(key), sd[key])
        assert r.get("model.norm.weight", dtype=torch.bfloat16).dtype == torch.bfloat16
        if sharded:  # file_of agrees with the index transformers wrote
            wm = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
            assert {k: r.file_of(k).name for k in r.keys()} == wm


def _reload(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("max_shard_bytes", [10**9, 20_000])
def test_write_loads_in_transformers_bitwise(ckpts, tmp_path, tied, max_shard_bytes):
    model, src = ckpts[tied, False]
    out = tmp_path / "out"
    with HFReader(src) as r:
        gen = json.loads((src / "generation_config.json").read_text())
        tok = tmp_path / "tokenizer.json"
        tok.write_text('{"fake": true}')
        write_hf_folder(out, ((k, r.get(k)) for k in r.keys()), r.config,
                        max_shard_bytes=max_shard_bytes, extra_files=[tok],
                        generation_config=gen)
        src_keys = r.keys()
    assert (out / "tokenizer.json").read_text() == '{"fake": true}'
    assert json.loads((out / "generation_config.json").read_text()) == gen
    assert read_hf_config(out) == read_hf_config(src)
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))
    assert torch.equal(_logits(_reload(out), IDS), _logits(model, IDS))

    index = out / "model.safetensors.index.json"
    if max_shard_bytes == 10**9:
        assert not index.exists() and [p.name for p in out.glob("*.safetensors")] == [
            "model.safetensors"]
        return
    meta = json.loads(index.read_text())
    sd = model.state_dict()
    assert meta["metadata"]["total_size"] == sum(sd[k].nbytes for k in src_keys)
    assert set(meta["weight_map"]) == set(src_keys)
    files = sorted({*meta["weight_map"].values()})
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    for name in files:  # each file holds exactly what the index says, under the size cap
        with safe_open(out / name, framework="pt") as f:
            keys = set(f.keys())
            assert f.metadata() == {"format": "pt"}
            assert keys == {k for k, v in meta["weight_map"].items() if v == name}
            size = sum(sd[k].nbytes for k in keys)
            assert size <= max_shard_bytes or len(keys) == 1


def test_write_state_dict_with_shared_storage(ckpts, tmp_path):
    """A tied model's own state_dict has two keys on one storage; safetensors alone refuses."""
    model, _ = ckpts[True, False]
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    out = write_hf_folder(tmp_path / "out", sd.items(), model.config.to_dict())
    with HFReader(out) as r:
        assert set(r.keys()) == set(sd)
        assert torch.equal(r.get("lm_head.weight"), sd["model.embed_tokens.weight"])
    assert torch.equal(_logits(_reload(out), IDS), _logits(model, IDS))


def test_round_trip_bitwise_keeps_dtype(ckpts, tmp_path):
    _, src = ckpts[False, True]
    with HFReader(src) as r:
        bf16 = {k: r.get(k, dtype=torch.bfloat16) for k in r.keys()}
    out = write_hf_folder(tmp_path / "a", bf16.items(), {"x": 1}, max_shard_bytes=4000)
    with HFReader(out) as r:
        assert r.keys() == sorted(bf16)
        for k, v in bf16.items():
            assert r.dtype(k) == torch.bfloat16
            got = r.get(k)
            assert got.dtype == torch.bfloat16 and torch.equal(got, v)


def test_tensors_streamed_one_at_a_time(tmp_path):
    """The writer holds one tensor at a time: when it asks for the next, every tensor before the
    one it just wrote is gone (only weak references are kept here)."""
    refs: list[weakref.ref] = []
    held_at_each_yield = []

    def gen():
        for i in range(6):
            held_at_each_yield.append([j for j, r in enumerate(refs) if r() is not None])
            t = torch.full((250,), float(i))  # 1000 bytes each
            refs.append(weakref.ref(t))
            yield f"t{i}", t
            del t

    out = write_hf_folder(tmp_path / "out", gen(), {}, max_shard_bytes=2000)
    assert held_at_each_yield == [[], [0], [1], [2], [3], [4]]
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    with HFReader(out) as r:
        assert all(torch.equal(r.get(f"t{i}"), torch.full((250,), float(i))) for i in range(6))


MIXED = {"b.w": torch.randn(3).bfloat16(), "a.w": torch.randn(2, 2), "c": torch.arange(4), "z": torch.zeros(5, dtype=torch.uint8),
         "aa": torch.randn(1).half(), "e": torch.ones(2, dtype=torch.bool), "s": torch.tensor(3.0),
         "empty": torch.zeros(0, 4), "ü": torch.randn(7), "t": torch.randn(3, 4).t()}


@pytest.mark.parametrize("max_shard_bytes", [10**6, 40])
def test_streamed_files_are_save_files_bytes(tmp_path, max_shard_bytes):
    """Each file the streaming writer makes is byte for byte what safetensors' save_file writes
    for the same tensors (mixed dtypes, a scalar, an empty and a non-contiguous tensor)."""
    out = write_hf_folder(tmp_path / "out", MIXED.items(), {}, max_shard_bytes=max_shard_bytes)
    index = out / safetensors_io.INDEX_NAME
    files = (json.loads(index.read_text())["weight_map"] if index.exists()
             else dict.fromkeys(MIXED, safetensors_io.SINGLE_NAME))
    assert (len(set(files.values())) > 1) == (max_shard_bytes == 40)
    for name in set(files.values()):
        keys = {k: MIXED[k].contiguous() for k, f in files.items() if f == name}
        save_file(keys, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
        assert (out / name).read_bytes() == (tmp_path / "ref.safetensors").read_bytes(), name


def test_crash_mid_write_keeps_old_folder(ckpts, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("previous export")
    calls = []
    real = safetensors_io._StreamedShard.finish

    def failing(self):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(self)

    monkeypatch.setattr(safetensors_io._StreamedShard, "finish", failing)
    tensors = ((f"t{i}", torch.zeros(250)) for i in range(4))
    with pytest.raises(OSError, match="simulated"):
        write_hf_folder(out, tensors, {}, max_shard_bytes=1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    monkeypatch.setattr(safetensors_io._StreamedShard, "finish", real)
    write_hf_folder(out, [("w", torch.ones(3))], {})  # a good write replaces it
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- errors: each names the file and, where there is one, the tensor --------------------------

def test_truncated_shard(copy_of):
    folder = copy_of(sharded=True)
    shard = folder / "model-00003-of-00008.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-7])
    with pytest.raises(UserError, match=r"model-00003-of-00008\.safetensors is truncated: "
                       rf"header promises {len(data)} bytes, file has {len(data) - 7}"):
        HFReader(folder)


def test_truncated_inside_header(copy_of):
    folder = copy_of()
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:50])
    with pytest.raises(UserError, match=r"model\.safetensors is corrupt or truncated"):
        HFReader(folder)


def test_garbage_header(copy_of):
    folder = copy_of()
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"\x00garbage!!\xff\xfe"
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"model\.safetensors has a corrupt safetensors header"):
        HFReader(folder)


def test_header_span_mismatch(copy_of):
    """A header whose shape disagrees with its byte span (safetensors would also refuse)."""
    folder = copy_of()
    path = folder / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].replace(b'"shape":[128,32]', b'"shape":[128,31]', 1)
    assert len(header) == n
    path.write_bytes(data[:8] + header + data[8 + n:])
    with pytest.raises(UserError, match=r"model\.safetensors has a corrupt header entry for "
                       r"tensor '(lm_head|model\.embed_tokens)\.weight'"):
        HFReader(folder)


def test_index_names_missing_shard(copy_of):
    folder = copy_of(sharded=True)
    (folder / "model-00005-of-00008.safetensors").unlink()
    with pytest.raises(UserError, match=r"model-00005-of-00008\.safetensors, which does not exist"):
        HFReader(folder)


def test_index_key_not_in_its_shard(copy_of):
    folder = copy_of(sharded=True)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = "model.norm.weight"
    right = index["weight_map"][key]
    wrong = next(v for v in index["weight_map"].values() if v != right)
    index["weight_map"][key] = wrong
    index_path.write_text(json.dumps(index))
    with pytest.raises(UserError, match=rf"'{key}' to shard .*{wrong}, which does not contain"):
        HFReader(folder)


def test_missing_key_did_you_mean(ckpts):
    folder = ckpts[False, True][1]
    with HFReader(folder) as r:
        with pytest.raises(UserError, match=r"'model\.norm\.weigth' is not in checkpoint folder "
                           rf".*{folder.name} \(did you mean 'model\.norm\.weight'\?\)"):
            r.get("model.norm.weigth")
        assert "model.norm.weigth" not in r


def test_check_shape(ckpts):
    folder = ckpts[False, True][1]
    with HFReader(folder) as r:
        r.check_shape("model.embed_tokens.weight", (128, 32))
        with pytest.raises(UserError, match=r"'model\.embed_tokens\.weight' in .*"
                           r"model-\d{5}-of-\d{5}\.safetensors has shape \[128, 32\], "
                           r"expected \[151936, 32\]"):
            r.check_shape("model.embed_tokens.weight", torch.Size([151936, 32]))


def test_no_config_or_no_folder(copy_of, tmp_path):
    folder = copy_of()
    (folder / "config.json").unlink()
    with pytest.raises(UserError, match=rf"folder .*{folder.name} has no config\.json"):
        HFReader(folder)
    with pytest.raises(UserError, match=r"nowhere does not exist"):
        HFReader(tmp_path / "nowhere")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"config\.json is not valid JSON"):
        read_hf_config(folder)


def test_no_weights_or_pickle_only(copy_of):
    folder = copy_of()
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"no model\.safetensors.*pickle"):
        HFReader(folder)


def test_loose_safetensors_files(copy_of):
    """Neither index nor model.safetensors: any *.safetensors files are read together."""
    folder = copy_of(sharded=True)
    (folder / "model.safetensors.index.json").unlink()
    with HFReader(folder) as r:
        assert len(r.keys()) == 25
    shutil.copyfile(folder / "model-00001-of-00008.safetensors", folder / "dup.safetensors")
    with pytest.raises(UserError, match=r"is in both .*dup\.safetensors"):
        HFReader(folder)


def test_extra_file_errors(tmp_path):
    with pytest.raises(UserError, match="extra file .*missing.json"):
        write_hf_folder(tmp_path / "o", [], {}, extra_files=[tmp_path / "missing.json"])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="would overwrite"):
        write_hf_folder(tmp_path / "o", [], {}, extra_files=[tmp_path / "config.json"])
    assert not (tmp_path / "o").exists()


def test_write_views_and_non_contiguous(tmp_path):
    """Views of one fused buffer and transposed tensors are written as their own values."""
    fused = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    q, k = fused[:2], fused[2:]
    t = torch.arange(12.0, requires_grad=True).reshape(3, 4).t()
    out = write_hf_folder(tmp_path / "o", [("q", q), ("k", k), ("t", t)], {})
    with HFReader(out) as r:
        assert torch.equal(r.get("q"), q) and torch.equal(r.get("k"), k)
        assert torch.equal(r.get("t"), t.detach()) and r.shape("t") == (4, 3)

"""Packing samples with document masks: positions restart per sample, attention stays inside
each, and the loss is the token-weighted mean of the per-sample losses. Oracle: transformers'
Qwen3 run on every sample alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import titanite
from tests.conftest import make_hf_checkpoint, read_metrics, stop_after, tiny_train_args
from tests.fixtures.chat import make_chat_tokenizer, toy_conversations, write_jsonl
from titanite.core.config import DataConfig, load_config
from titanite.core.errors import UserError
from titanite.data import load_tokenizer
from titanite.data.chat import IGNORE_INDEX, ChatStats, chat_samples
from titanite.data.loader import PackedLoader
from titanite.kernels import reference
from titanite.models.qwen3.handle import Qwen3Model
from titanite.run.trainer import Trainer

SEQ = 128


@pytest.fixture(scope="module")
def chat_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok_dir = make_chat_tokenizer(root / "tok")
    return make_hf_checkpoint(root / "hf", tok_dir)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    rows = toy_conversations(2)
    # Multi-turn rows of varied length, so windows hold different numbers of samples.
    for i in range(6):
        turns = []
        for j in range(1 + i % 2):
            turns += [{"role": "user", "content": f"question {i} {j}"},
                      {"role": "assistant", "content": "the answer is " + "blue " * (i + j)}]
        rows.append({"messages": turns})
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", rows)


def data_cfg(path, **kw) -> DataConfig:
    return DataConfig(**{"path": str(path), "format": "chat", "seq_len": SEQ, "shuffle": False, **kw})


def samples(path, hf) -> list[tuple[list[int], list[int]]]:
    tok = load_tokenizer("", str(hf))
    return [(i.tolist(), label.tolist()) for i, label in chat_samples(data_cfg(path), tok, ChatStats())]


def greedy_groups(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Sample indices per window when samples fill windows in order (the rule to check)."""
    groups, used = [[]], 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > seq_len:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def hf_loss_sums(model, sample_list) -> tuple[float, int]:
    """Summed cross-entropy and label count over samples, each run alone through transformers."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in sample_list:
            logits = model(torch.tensor([ids])).logits[0]
            total += F.cross_entropy(logits.float(), torch.tensor(labels), ignore_index=IGNORE_INDEX,
                                     reduction="sum").item()
            count += sum(label != IGNORE_INDEX for label in labels)
    return total, count


def test_windows_hold_whole_samples_with_restarting_positions(chat_hf, chat_data):
    ss = samples(chat_data, chat_hf)
    assert max(len(i) for i, _ in ss) <= SEQ  # nothing is cut
    groups = greedy_groups([len(i) for i, _ in ss], SEQ)
    loader = PackedLoader(data_cfg(chat_data), load_tokenizer("", str(chat_hf)), batch_size=1, seed=0)
    assert loader.num_windows == len(groups) and len(groups) < len(ss)  # really packed
    pad = load_tokenizer("", str(chat_hf)).eos_id
    for group in groups:
        b = loader.next_batch()
        ids = sum((ss[i][0] for i in group), [])
        labels = sum((ss[i][1] for i in group), [])
        positions = sum((list(range(len(ss[i][0]))) for i in group), [])
        docs = sum(([k] * len(ss[i][0]) for k, i in enumerate(group)), [])
        n_pad = SEQ - len(ids)
        assert b["input_ids"][0].tolist() == ids + [pad] * n_pad
        assert b["labels"][0].tolist() == labels + [IGNORE_INDEX] * n_pad
        assert b["position_ids"][0].tolist() == positions + list(range(n_pad))
        assert b["document_ids"][0].tolist() == docs + [len(group)] * n_pad


@pytest.mark.parametrize("packing", ["documents", "pad"])
def test_packed_loss_is_token_weighted_mean_of_per_sample_losses(chat_hf, chat_data, packing):
    hf = transformers.AutoModelForCausalLM.from_pretrained(chat_hf, dtype=torch.float32).eval()
    native = titanite.load_pretrained(chat_hf)
    ss = samples(chat_data, chat_hf)
    want_sum, want_count = hf_loss_sums(hf, ss)

    loader = PackedLoader(data_cfg(chat_data, packing=packing), load_tokenizer("", str(chat_hf)),
                          batch_size=1, seed=0)
    batch = loader.windows.batch(torch.arange(loader.num_windows).numpy())
    assert ("document_ids" in batch) == (packing == "documents")
    with torch.no_grad():
        logits = native(batch["input_ids"], position_ids=batch["position_ids"],
                        document_ids=batch.get("document_ids"))
    got = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                          reduction="sum").item()
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == want_count
    assert got / want_count == pytest.approx(want_sum / want_count, rel=1e-5)

    if packing == "documents":
        # Each sample's logits in the packed window are its logits alone.
        group = greedy_groups([len(i) for i, _ in ss], SEQ)[0]
        assert len(group) >= 2
        off = 0
        for i in group:
            alone = hf(torch.tensor([ss[i][0]])).logits[0]
            n = len(ss[i][0])
            torch.testing.assert_close(logits[0, off:off + n], alone, atol=2e-5, rtol=1e-5)
            off += n
        # Without the mask the second sample sees the first: its logits move far past that tolerance.
        with torch.no_grad():
            leaky = native(batch["input_ids"], position_ids=batch["position_ids"])
        second = slice(len(ss[group[0]][0]), off)
        assert (leaky[0, second] - logits[0, second]).abs().max() > 1e-3


def test_reference_attention_with_documents_matches_separate_sequences():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    for t in (q, k, v):
        t.requires_grad_(True)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 3]])
    attend = reference("attention")
    out = attend(q, k, v, 8 ** -0.5, document_ids=docs)
    (out * torch.randn_like(out)).sum().backward()
    for lo, hi in ((0, 3), (3, 7), (7, 9), (9, 10)):
        sl = slice(lo, hi)
        alone = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl].repeat_interleave(2, 1),
                                               v[:, :, sl].repeat_interleave(2, 1), is_causal=True)
        torch.testing.assert_close(out[:, :, sl], alone)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_training_step_loss_is_normalised_over_the_whole_step(tmp_path, chat_hf, chat_data):
    """Step 1's loss (2 micro-batches of 2 windows) is the token-weighted mean over every sample
    in those 4 windows, computed by transformers at the initial weights."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(chat_hf, dtype=torch.float32).eval()
    ss = samples(chat_data, chat_hf)
    first_four = [i for g in greedy_groups([len(i) for i, _ in ss], SEQ)[:4] for i in g]
    want_sum, want_count = hf_loss_sums(hf, [ss[i] for i in first_four])

    out = tmp_path / "run"
    args = tiny_train_args(chat_hf, chat_data, out, steps=1, **{
        "data.format": "chat", "data.seq_len": SEQ, "data.shuffle": False, "training.batch_size": 2,
        "training.global_batch_size": 4, "checkpoint.export_hf": False})
    Trainer(load_config(None, args)).train()
    row = read_metrics(out)[0]
    assert row["loss"] == pytest.approx(want_sum / want_count, rel=1e-5)
    assert row["data_samples"] == len(ss) and row["data_dropped"] == 0 and 0 < row["data_fill"] <= 1


def test_document_packing_needs_a_backend_with_document_masks(tmp_path, chat_hf, chat_data, monkeypatch):
    monkeypatch.setattr(Qwen3Model, "supports_document_masks", False)
    args = tiny_train_args(chat_hf, chat_data, tmp_path / "run", steps=1, **{"data.format": "chat"})
    with pytest.raises(UserError, match="data.packing = 'documents'.*model.spec = 'qwen3'.*'pad'"):
        Trainer(load_config(None, args))
    # One sample per sequence needs no mask, so it is allowed.
    Trainer(load_config(None, args + ["--data.packing=pad", "--checkpoint.export_hf=false"])).train()


def test_text_documents_packing_keeps_each_document_apart(tmp_path, tiny_tokenizer_dir):
    texts = ["the model reads tokens", "and predicts the next token while the optimizer lowers the loss",
             "on every step", "of training data in small batches " * 8]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    tok = tokenizers_for(tiny_tokenizer_dir)
    eot = tok.token_to_id("<|endoftext|>")
    docs = [tok.encode(t, add_special_tokens=False).ids + [eot] for t in texts]
    assert max(len(d) for d in docs) > 24  # one document is cut
    loader = PackedLoader(DataConfig(path=str(path), seq_len=24, packing="documents", shuffle=False),
                          load_tokenizer(str(tiny_tokenizer_dir)), batch_size=1, seed=0)
    groups = greedy_groups([min(len(d), 24) for d in docs], 24)
    assert loader.num_windows == len(groups)
    for group in groups:
        b = loader.next_batch()
        ids = sum((docs[i][:24] for i in group), [])
        # Each document learns its own next tokens; its last position (or cut) has nothing after it.
        labels = sum(((docs[i][1:] + [IGNORE_INDEX])[:24] for i in group), [])
        n = len(ids)
        assert b["input_ids"][0, :n].tolist() == ids
        assert b["labels"][0].tolist() == labels + [IGNORE_INDEX] * (24 - n)
        assert b["position_ids"][0, :n].tolist() == sum((list(range(min(len(docs[i]), 24))) for i in group), [])


def tokenizers_for(folder):
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_chat_run_resumes_like_an_uninterrupted_run(tmp_path, chat_hf, chat_data):
    """Packed chat batches continue where the checkpoint left off (epochs roll over in between)."""
    extra = {"data.format": "chat", "data.seq_len": SEQ, "training.batch_size": 2,
             "checkpoint.export_hf": False, "eval.path": chat_data, "eval.interval": 3}
    full, split = tmp_path / "full", tmp_path / "split"
    Trainer(load_config(None, tiny_train_args(chat_hf, chat_data, full, steps=8, **extra))).train()
    first = Trainer(load_config(None, tiny_train_args(chat_hf, chat_data, split, steps=8, **extra)))
    assert 4 < first.loader.batches_per_epoch < 8  # the resumed half starts a new epoch
    head = stop_after(first, 4)
    Trainer(load_config(None, tiny_train_args(chat_hf, chat_data, split, steps=8, **extra))).train()
    want = read_metrics(full)
    assert head + [r["loss"] for r in read_metrics(split)][-4:] == [r["loss"] for r in want]
    assert [r["step"] for r in want if "eval_loss" in r] == [3, 6, 8]
    assert read_metrics(split)[-1]["eval_loss"] == want[-1]["eval_loss"]

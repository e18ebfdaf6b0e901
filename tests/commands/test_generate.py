"""Generation: the KV cache against the full forward, greedy decoding against transformers'
generate(), top-p against transformers' TopPLogitsWarper, sampling frequencies against the
distribution they sample from, and a tiny chat model fine-tuned on a toy task answering its
prompts through `titanite generate`."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from transformers.generation.logits_process import TopPLogitsWarper

import titanite
from tests.conftest import TINY_MOE, TINY_VOCAB, make_hf_checkpoint, read_metrics, run_cli, tiny_train_args
from tests.fixtures.chat import TOY_QA, make_chat_tokenizer, toy_conversations, write_jsonl
from titanite.commands.generate import (
    Sampling,
    forward_cached,
    generate,
    load_generator,
    new_cache,
    sample_next,
    top_p_filter,
)
from titanite.core.config import load_config
from titanite.core.errors import UserError
from titanite.run.trainer import Trainer


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cached_logits_equal_the_full_forward(tmp_path, tiny_tokenizer_dir, moe):
    extra = dict(TINY_MOE, num_experts=8) if moe else {}
    model = titanite.load_pretrained(make_hf_checkpoint(tmp_path / "hf", tiny_tokenizer_dir, **extra))
    ids = torch.randint(0, TINY_VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)  # [2, 20, V]
        cache = new_cache(model, batch=2, max_len=20)
        got = []
        # A first chunk (plain causal), a later chunk (offset mask), then one token at a time.
        for lo, hi in [(0, 6), (6, 11)] + [(i, i + 1) for i in range(11, 20)]:
            got.append(forward_cached(model, ids[:, lo:hi], cache, last_only=False))
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-5, rtol=1e-5)
    assert cache.length == 20


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_matches_transformers_generate(tmp_path, tiny_tokenizer_dir, seed):
    folder = make_hf_checkpoint(tmp_path / "hf", tiny_tokenizer_dir, seed=seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Larger weights than the default init, so the argmax is decisive rather than near-tied.
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(10)
    hf.save_pretrained(folder)
    prompt = torch.randint(0, TINY_VOCAB, (1, 7), generator=torch.Generator().manual_seed(seed)).tolist()[0]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, 7:].tolist()
    got = generate(titanite.load_pretrained(folder), prompt, Sampling(max_new_tokens=24))
    assert got == want and len(got) == 24 and len(set(got)) > 5


def test_stop_token_ends_generation(tiny_hf):
    model = titanite.load_pretrained(tiny_hf)
    full = generate(model, [5, 6, 7], Sampling(max_new_tokens=12))
    stop_at = full[4]
    cut = generate(model, [5, 6, 7], Sampling(max_new_tokens=12), stop_ids=[stop_at])
    assert cut == full[: full.index(stop_at) + 1]


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_what_transformers_keeps(top_p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2)) * 3
    want = TopPLogitsWarper(top_p)(None, logits.clone())
    got = top_p_filter(logits, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])


def test_sampling_frequencies_follow_temperature_and_top_p():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    s = Sampling(temperature=0.7, top_p=0.9, seed=0)
    n = 40000
    draws = sample_next(logits.expand(n, -1), s, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=6).double() / n
    want = TopPLogitsWarper(0.9)(None, (logits / 0.7)[None].clone())[0].softmax(-1).double()
    assert want[-1] == 0 and freq[-1] == 0  # outside the nucleus: never drawn
    assert (freq - want).abs().max() < 0.015  # ~6 standard deviations at n = 40000
    greedy = sample_next(logits[None], Sampling(temperature=0.0), None)
    assert greedy.tolist() == [0]


def test_bad_sampling_options_and_model_folders_are_user_errors(tmp_path):
    for kw, flag in [({"temperature": -1.0}, "--temperature"), ({"top_p": 0.0}, "--top-p"),
                     ({"max_new_tokens": 0}, "--max-new-tokens")]:
        with pytest.raises(UserError, match=flag):
            Sampling(**kw).check()
    with pytest.raises(UserError, match="neither a Hugging Face folder"):
        load_generator(tmp_path)
    proc = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert proc.returncode == 2 and "is not a folder" in proc.stderr


@pytest.mark.slow
def test_fine_tuned_chat_model_answers_through_titanite_generate(tmp_path):
    hf_dir = make_hf_checkpoint(tmp_path / "hf", make_chat_tokenizer(tmp_path / "tok"))
    data = write_jsonl(tmp_path / "train.jsonl", toy_conversations(8))
    out = tmp_path / "run"
    Trainer(load_config(None, tiny_train_args(hf_dir, data, out, steps=80, **{
        "data.format": "chat", "data.seq_len": 128, "training.lr": 5e-3, "training.warmup_steps": 10,
        "metrics.log_interval": 20, "checkpoint.interval": 0, "model.init": "random"}))).train()
    assert read_metrics(out)[-1]["loss"] < 0.5

    args = ["generate", "--model", str(out / "hf"), "--max-new-tokens", "12"]
    for question, _ in TOY_QA:
        args += ["--prompt", question]
    proc = run_cli(*args, check=True)
    # Qwen3's template: the answer follows an empty think block and ends with <|im_end|>.
    answers = re.findall(r"<think>\s*</think>\s*(\S+)\s*$", proc.stdout, flags=re.M)
    assert answers == [a for _, a in TOY_QA], proc.stdout

    # The run folder itself (its latest training checkpoint) answers the same.
    gen = load_generator(out)
    for question, answer in TOY_QA[:3]:
        text = gen.complete(question, Sampling(max_new_tokens=12))
        assert text.split("</think>")[-1].strip() == answer


def test_checkpoint_of_the_hf_backend_generates_like_transformers(tmp_path, tiny_hf, tiny_data):
    """A training checkpoint of another backend is read back through its HF export."""
    out = tmp_path / "run"
    Trainer(load_config(None, tiny_train_args(tiny_hf, tiny_data, out, steps=2, **{"model.spec": "hf"}))).train()
    gen = load_generator(out)  # the run folder: its latest checkpoint, step-2
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    prompt = [5, 6, 7, 8]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, 4:].tolist()
    assert generate(gen.model, prompt, Sampling(max_new_tokens=8)) == want

"""`titanite generate` on Qwen3.5 / Qwen3-Next: the native model decodes with a cache that holds
keys and values for the full-attention layers and the conv window and recurrent state for the
Gated DeltaNet layers (titanite/models/qwen3/kv_cache.py).

transformers is the oracle: greedy decoding gives its `generate(do_sample=False)` tokens, and
every cached step's logits are the full forward's. The prompt is longer than the conv window
(kernel 4), so decode steps read real inputs from the cached window, not its zero padding.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli
from tests.fixtures.hybrid import make_hybrid_checkpoint
from titanite.commands.generate import Sampling, forward_cached, generate, load_generator, new_cache

PROMPT = [5, 17, 42, 7, 99, 3, 11, 60, 23, 8]  # 10 tokens > the conv window of 3
NEW = 8


def _folder(tmp_path, family, tokenizer_dir):
    folder = make_hybrid_checkpoint(tmp_path / family, family)
    for f in tokenizer_dir.iterdir():  # load_generator needs a tokenizer beside the weights
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def _transformers_generate(folder, family) -> list[int]:
    import transformers

    cls = (transformers.Qwen3_5ForConditionalGeneration if family == "qwen3_5"
           else transformers.AutoModelForCausalLM)
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next", "qwen3_5"])
def test_greedy_matches_transformers_and_cached_logits_equal_full_forward(tmp_path, tiny_tokenizer_dir, family):
    folder = _folder(tmp_path, family, tiny_tokenizer_dir)
    model = load_generator(folder).model  # qwen3_5: the multimodal folder's text model
    ours = generate(model, PROMPT, Sampling(max_new_tokens=NEW))
    assert ours == _transformers_generate(folder, family)
    ids = torch.tensor([PROMPT + ours])
    with torch.no_grad():
        full = model(ids)  # [1, S, V], no cache
        cache = new_cache(model, 1, ids.shape[1])
        prefill = forward_cached(model, ids[:, :len(PROMPT)], cache, last_only=False)
        worst = (prefill - full[:, :len(PROMPT)]).abs().max().item()
        for t in range(len(PROMPT), ids.shape[1]):  # one token at a time from the cached state
            worst = max(worst, (forward_cached(model, ids[:, t:t + 1], cache) - full[:, t]).abs().max().item())
    assert worst <= 1e-5
    assert cache.k.shape[0] == 1 and len(cache.delta) == 3  # 1 attention layer, 3 Gated DeltaNet layers
    assert all(d.state.dtype == torch.float32 and d.state.shape == (1, 4, 16, 8) for d in cache.delta.values())


def test_generate_command_runs_on_a_hybrid_folder(tmp_path, tiny_tokenizer_dir):
    folder = _folder(tmp_path, "qwen3_next", tiny_tokenizer_dir)
    proc = run_cli("generate", "--model", str(folder), "--prompt", "hello world", "--raw",
                   "--max-new-tokens", "5", check=True)
    assert proc.stdout.strip()  # some text, decoded from the generated ids

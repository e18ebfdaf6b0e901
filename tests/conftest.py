"""Shared fixtures: tiny real Hugging Face checkpoints and a tiny real tokenizer, built here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_VOCAB = 384
# The tiny MoE every test starts from (add keys to vary it): 4 experts, top-2, renormalised.
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)

# Keep the 2-core CI machine responsive and results reproducible.
torch.set_num_threads(min(2, torch.get_num_threads()))
# Token stores (data.cache_dir's default) and the measured CPU peak go to one folder per test
# session, inherited by every process a test starts, never to the user's ~/.cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="titanite-tests-cache-")
# W&B's system monitor (wandb-symon) logs to WANDB_CACHE_DIR, else ~/.cache/wandb whatever XDG says.
os.environ["WANDB_CACHE_DIR"] = os.path.join(os.environ["XDG_CACHE_HOME"], "wandb")
# Fixture modules that test files load with `pytest_plugins` (session-scoped runs shared by
# several files): those files import them before pytest would, so ask for their asserts to be
# rewritten here.
pytest.register_assert_rewrite("tests.fixtures.lora", "tests.fixtures.reliability")


def corpus_texts(n: int = 200) -> list[str]:
    """Deterministic English-like documents with learnable structure."""
    words = ("the model reads tokens and predicts the next token while the optimizer lowers "
             "the loss on every step of training data in small batches").split()
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(20 + i % 30)) for i in range(n)]


def make_tiny_tokenizer(d: Path) -> Path:
    """Train a tiny byte-level BPE tokenizer (TINY_VOCAB - 8 ids) on corpus_texts into folder `d`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 8, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_texts(), trainer)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return d


def write_corpus(path: Path) -> Path:
    """corpus_texts as JSON lines with a 'text' field."""
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts()))
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def make_hf_checkpoint(folder: Path, tokenizer_dir: Path | None = None, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised transformers Qwen3 (or Qwen3-MoE) to `folder`."""
    import transformers

    kw = dict(vocab_size=TINY_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    kw.update(overrides)
    torch.manual_seed(seed)
    if "num_experts" in kw:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
    model.save_pretrained(folder)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


@pytest.fixture
def tiny_hf(tmp_path, tiny_tokenizer_dir) -> Path:
    return make_hf_checkpoint(tmp_path / "tiny-hf", tiny_tokenizer_dir)


@pytest.fixture
def tiny_data(tmp_path) -> Path:
    return write_corpus(tmp_path / "data.jsonl")


def run_cli(*args: str, env: dict | None = None, timeout: float = 600, module: str = "titanite.cli",
            check: bool = False) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]


def tiny_train_args(hf: Path, data: Path, out: Path, steps: int = 6, **extra) -> list[str]:
    """Overrides for a few-second run of a tiny model (fp32, CPU, log every step)."""
    opts = {"job.output_dir": out, "model.hf_path": hf, "data.path": data, "data.seq_len": 32,
            "training.steps": steps, "training.batch_size": 4, "training.lr": 1e-3,
            "training.warmup_steps": min(2, steps), "metrics.log_interval": 1, "metrics.peak_tflops": 1.0,
            "metrics.progress_bar": "off", "checkpoint.interval": 2}
    opts.update(extra)
    return [f"--{k}={v}" for k, v in opts.items()]


def stop_after(trainer, steps: int) -> list[float]:
    """Drive `steps` optimizer steps of `trainer` by hand, save a checkpoint there (off the
    checkpoint interval), and release its output folder, as a run interrupted there would.
    Returns the losses of those steps."""
    head = []
    for _ in range(steps):
        head.append(trainer.train_step().read()["loss"])
        trainer.step += 1
    trainer._save()
    trainer.close()
    return head


# -- kernels registered by a test --------------------------------------------------------------


@pytest.fixture
def scratch_impls():
    """(op, name) of implementations a test registers; removed after it."""
    from titanite.kernels import registry

    added: list[tuple[str, str]] = []
    yield added
    for op, name in added:
        registry.unregister(op, name)


def counting(op: str, name: str, scratch: list, calls: list) -> None:
    """Register `name` for `op`: the reference, appending `name` to `calls` on each call."""
    from titanite import kernels
    from titanite.kernels import registry

    ref = kernels.reference(op)

    def impl(*args, **kw):
        calls.append(name)
        return ref(*args, **kw)

    impl.__signature__ = registry.signature(op)
    kernels.register(op, name)(impl)
    scratch.append((op, name))


# -- transformers as the oracle ---------------------------------------------------------------


def transformers_model(folder: Path):
    """transformers' own model of a folder: SDPA attention and eager experts (the per-expert loop,
    the most direct statement of the math)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                             experts_implementation="eager").eval()


def transformers_grads_on_disk(model) -> dict[str, torch.Tensor]:
    """transformers' gradients under the on-disk (per-expert) keys, split here independently of
    titanite's adapters. In memory transformers 5.x fuses the experts: gate_up_proj [E, 2I, H]
    (gate rows first), down_proj [E, H, I]."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = p.grad.chunk(2, dim=1)
            for e in range(p.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(p.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = p.grad[e]
        else:
            out[name] = p.grad
    return out


def titanite_grads_on_disk(model) -> dict[str, torch.Tensor]:
    """A titanite model's gradients under the on-disk keys, through its backend's adapter."""
    from titanite.models.handle import handle_of

    adapter = handle_of(model).state_dict_adapter()
    return {k: g for n, p in model.named_parameters() for k, g in adapter.to_hf(n, p.grad)}


def assert_grads_match(ours, theirs, tol: float = 1e-5) -> None:
    """Every gradient within `tol` of transformers', relative to the tensor's own scale when that
    exceeds 1 (fp32 rounding of an O(100) embedding gradient alone is ~1e-5 absolute)."""
    mine, ref = titanite_grads_on_disk(ours), transformers_grads_on_disk(theirs)
    assert set(mine) == set(ref)
    errors = {k: (mine[k] - ref[k]).abs().max().item() / max(1.0, ref[k].abs().max().item()) for k in mine}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, (worst, errors[worst])

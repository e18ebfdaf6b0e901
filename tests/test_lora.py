"""LoRA on both backends, against peft and transformers as the oracles.

One short LoRA run per (backend, dense/MoE) is shared by the module. peft loads the run's
adapter folder onto transformers' base model and must give titanite's logits; peft's own
merge_and_unload must give titanite's merged export; the two backends' losses must agree; the
base must come out of training bit for bit as it went in; and a resumed run must repeat the
uninterrupted one's losses exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TINY_MOE, make_hf_checkpoint, read_metrics, run_cli, stop_after, tiny_train_args
from titanite.checkpoint import training_state
from titanite.config import load_config
from titanite.errors import UserError
from titanite.export import export_checkpoint, load_checkpoint_model
from titanite.trainer import Trainer

STEPS = 4
# MoE with a dense layer too (mlp_only_layers), so dense MLP and expert adapters are both there.
MOE = dict(TINY_MOE, mlp_only_layers=[1])
KINDS = {"dense": {}, "moe": MOE}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from tests.conftest import write_corpus

    return write_corpus(tmp_path_factory.mktemp("lora-data") / "data.jsonl")


@pytest.fixture(scope="module")
def bases(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    return {kind: make_hf_checkpoint(tmp_path_factory.mktemp(f"base-{kind}"), tiny_tokenizer_dir, seed=3, **kw)
            for kind, kw in KINDS.items()}


def lora_args(base: Path, data: Path, out: Path, steps: int = STEPS, **extra) -> list[str]:
    opts = {"lora.enabled": "true", "lora.rank": 4, "lora.alpha": 8, "training.lr": 1e-2,
            "checkpoint.export_merged": "true", "checkpoint.interval": 2, "checkpoint.keep_latest": 0}
    opts.update(extra)
    return tiny_train_args(base, data, out, steps=steps, **opts)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, bases, data) -> dict[tuple[str, str], Path]:
    """(spec, kind) -> the output folder of a finished LoRA run."""
    root = tmp_path_factory.mktemp("lora-runs")
    out = {}
    for kind, base in bases.items():
        for spec in ("qwen3", "hf"):
            folder = root / f"{spec}-{kind}"
            Trainer(load_config(None, lora_args(base, data, folder, **{"model.spec": spec}))).train()
            out[spec, kind] = folder
    return out


CASES = [(spec, kind) for kind in KINDS for spec in ("qwen3", "hf")]
IDS = [f"{spec}-{kind}" for spec, kind in CASES]


def ids() -> torch.Tensor:
    return torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))


def titanite_logits(run: Path) -> torch.Tensor:
    _, handle = load_checkpoint_model(training_state.latest_checkpoint(run / "checkpoints"))
    with torch.no_grad():
        return handle.module.eval()(ids())


def base_model(base: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


@pytest.mark.parametrize("spec,kind", CASES, ids=IDS)
def test_peft_loads_the_adapter_with_titanite_logits(runs, bases, spec, kind):
    from peft import PeftModel

    run = runs[spec, kind]
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert bool(config.get("target_parameters")) == (kind == "moe")
    tensors = load_file(run / "adapter" / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
    # The adapters really trained: every B moved off its zero init.
    assert all(t.abs().max() > 0 for k, t in tensors.items() if ".lora_B." in k)
    peft_model = PeftModel.from_pretrained(base_model(bases[kind]), run / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(ids()).logits
        plain = base_model(bases[kind])(ids()).logits
    ours = titanite_logits(run)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (plain - theirs).abs().max().item() > 1e-3  # the adapter changes the model


@pytest.mark.parametrize("spec,kind", CASES, ids=IDS)
def test_merged_export_is_peft_merge_and_loads_in_transformers(runs, bases, spec, kind):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = runs[spec, kind]
    merged = PeftModel.from_pretrained(base_model(bases[kind]), run / "adapter").merge_and_unload()
    ours = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()
    theirs = merged.state_dict()
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert (mine[key] - theirs[key]).abs().max().item() <= 1e-6, key
    with torch.no_grad():
        assert (ours(ids()).logits - merged(ids()).logits).abs().max().item() <= 1e-5


def test_save_pretrained_of_a_lora_model_writes_it_merged(runs, tmp_path):
    import titanite

    run = runs["qwen3", "moe"]
    _, handle = load_checkpoint_model(training_state.latest_checkpoint(run / "checkpoints"))
    titanite.save_pretrained(handle.module, tmp_path / "saved")
    ours, theirs = load_file(tmp_path / "saved" / "model.safetensors"), load_file(run / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_merged_weight_is_base_plus_scaled_b_a(runs, bases):
    """The dense q_proj of layer 0, by hand: W + B @ A x alpha / rank."""
    run = runs["qwen3", "dense"]
    key = "model.layers.0.self_attn.q_proj"
    a = load_file(run / "adapter" / "adapter_model.safetensors")
    base = load_file(bases["dense"] / "model.safetensors")[f"{key}.weight"]
    merged = load_file(run / "hf" / "model.safetensors")[f"{key}.weight"]
    expected = base + a[f"base_model.model.{key}.lora_B.weight"] @ a[f"base_model.model.{key}.lora_A.weight"] * (8 / 4)
    assert (merged - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_both_backends_train_the_same_losses(runs, kind):
    native = [r["loss"] for r in read_metrics(runs["qwen3", kind])]
    hf = [r["loss"] for r in read_metrics(runs["hf", kind])]
    assert len(native) == STEPS and len(set(native)) > 1
    for a, b in zip(native, hf, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a)


@pytest.mark.parametrize("spec,kind", CASES, ids=IDS)
def test_checkpoint_holds_only_adapters_and_their_optimizer_state(runs, spec, kind):
    from titanite.checkpoint import dcp_safe

    ckpt = training_state.latest_checkpoint(runs[spec, kind] / "checkpoints")
    keys = dcp_safe.read_metadata(ckpt).state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.")]
    assert model_keys and optim_keys
    # Every model entry is an adapter factor or one of the MoE router's buffers (never a weight).
    buffers = ("router.expert_bias", "router.tokens_per_expert")
    assert all("lora_" in k or k.endswith(buffers) for k in model_keys), \
        [k for k in model_keys if "lora_" not in k][:3]
    assert any("lora_" in k for k in model_keys)
    assert all("lora_" in k for k in optim_keys)


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_base_is_unchanged_and_only_adapters_have_optimizer_state(bases, data, tmp_path, spec):
    trainer = Trainer(load_config(None, lora_args(bases["moe"], data, tmp_path / "run", steps=2,
                                                  **{"model.spec": spec})))
    trainer.train()
    on_disk = load_file(bases["moe"] / "model.safetensors")
    exported = dict(trainer.handle.hf_state_dict())  # the base, without the adapters
    assert exported.keys() == on_disk.keys()
    for key, t in on_disk.items():
        assert torch.equal(exported[key], t), key
    adapters = {id(p) for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert adapters and set(map(id, trainer.optimizer.state)) == adapters
    assert all(not p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_resume_repeats_the_uninterrupted_losses(bases, data, tmp_path, spec):
    args = {"model.spec": spec}
    full = Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "full", steps=5, **args)))
    full.train()
    expected = [r["loss"] for r in read_metrics(tmp_path / "full")]
    head = stop_after(Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "cut", steps=5,
                                                          **args))), 2)
    Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "cut", steps=5, **args))).train()
    tail = [r["loss"] for r in read_metrics(tmp_path / "cut") if r["step"] > 2]
    assert head + tail == expected


def test_dropout_resumes_exactly_too(bases, data, tmp_path):
    args = {"lora.dropout": 0.1}
    Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "full", steps=4, **args))).train()
    expected = [r["loss"] for r in read_metrics(tmp_path / "full")]
    head = stop_after(Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "cut", steps=4,
                                                          **args))), 2)
    Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "cut", steps=4, **args))).train()
    assert head + [r["loss"] for r in read_metrics(tmp_path / "cut") if r["step"] > 2] == expected


def test_export_command_writes_adapter_and_merged(runs, tmp_path):
    run = runs["hf", "moe"]
    ckpt = training_state.latest_checkpoint(run / "checkpoints")
    proc = run_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "adapter"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged"), "--merged")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("adapter_model.safetensors",):
        assert load_file(tmp_path / "adapter" / name).keys() == load_file(run / "adapter" / name).keys()
        for k, t in load_file(tmp_path / "adapter" / name).items():
            assert torch.equal(t, load_file(run / "adapter" / name)[k]), k
    ours, theirs = load_file(tmp_path / "merged" / "model.safetensors"), load_file(run / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # the published layout: per-expert keys and the source's config.json
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in ours)


def test_merged_flag_on_a_full_checkpoint_is_refused(tmp_path, bases, data):
    out = tmp_path / "full"
    Trainer(load_config(None, tiny_train_args(bases["dense"], data, out, steps=1))).train()
    with pytest.raises(UserError, match="not a LoRA run"):
        export_checkpoint(training_state.latest_checkpoint(out / "checkpoints"), tmp_path / "x", 5000, merged=True)


@pytest.mark.parametrize("spec,kind", [("qwen3", "moe"), ("hf", "dense")], ids=["qwen3-moe", "hf-dense"])
def test_generate_from_the_run_and_from_the_adapter(runs, bases, spec, kind):
    """The run folder (its checkpoint) and the adapter folder on its base decode the same greedy
    tokens as peft's model does with transformers' generate."""
    from peft import PeftModel

    from titanite.generate import Sampling, generate, load_generator

    run = runs[spec, kind]
    prompt = [5, 17, 42, 7]
    sampling = Sampling(max_new_tokens=6)
    from_run = load_generator(run)
    from_adapter = load_generator(run / "adapter")
    a = generate(from_run.model, prompt, sampling)
    b = generate(from_adapter.model, prompt, sampling)
    peft_model = PeftModel.from_pretrained(base_model(bases[kind]), run / "adapter").eval()
    with torch.no_grad():
        out = peft_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
    assert a == b == out[0, len(prompt):].tolist()


def test_eval_runs_on_a_lora_run(bases, data, tmp_path):
    out = tmp_path / "run"
    Trainer(load_config(None, lora_args(bases["dense"], data, out, steps=2,
                                        **{"eval.path": data, "eval.max_batches": 2}))).train()
    rows = read_metrics(out)
    assert any("eval_loss" in r or "eval/loss" in r for r in rows), rows[-1]


def test_adapter_path_starts_from_an_adapter(runs, bases, data, tmp_path):
    """A run started from another run's adapter begins at that run's final model."""
    run = runs["qwen3", "dense"]
    out = tmp_path / "more"
    trainer = Trainer(load_config(None, lora_args(bases["dense"], data, out, steps=1,
                                                  **{"lora.adapter_path": run / "adapter"})))
    with torch.no_grad():
        first = trainer.model.eval()(ids())
    trainer.close()
    assert (first - titanite_logits(run)).abs().max().item() <= 1e-5


# -- bad input: one message, exit 2 ------------------------------------------------------------

BAD = {
    "unknown target": ({"lora.target_modules": '["q_proj", "qkv_proj"]'}, "'qkv_proj' is not a module name titanite knows; this model has: q_proj"),
    "target this model lacks": ({"lora.target_modules": '["experts.down_proj"]'}, "'experts.down_proj' is not a module this model has"),
    "rank 0": ({"lora.rank": 0}, "'lora.rank' must be a positive integer"),
    "dropout under tensor parallel": ({"parallelism.tp": 2, "lora.dropout": 0.1}, "would draw a different mask on each"),
    "no base": ({"model.hf_path": ""}, "'model.hf_path' is not set"),
    "bf16 base in fp32": ({"lora.base_dtype": "bf16"}, "a bf16 base needs bf16 compute"),
    "merged without export": ({"checkpoint.export_hf": "false"}, "'checkpoint.export_hf' is false"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_lora_settings_are_refused(case, bases, data, tmp_path):
    extra, message = BAD[case]
    with pytest.raises(UserError, match=_re(message)):
        Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "run", **extra)))
    assert not (tmp_path / "run" / "config.toml").exists()


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_dropout_on_experts_is_refused(bases, data, tmp_path, spec):
    with pytest.raises(UserError, match="MoE experts are targeted"):
        Trainer(load_config(None, lora_args(bases["moe"], data, tmp_path / "run",
                                            **{"lora.dropout": 0.1, "model.spec": spec})))


def test_export_merged_without_lora_is_refused(bases, data, tmp_path):
    with pytest.raises(UserError, match="'checkpoint.export_merged' merges LoRA adapters"):
        load_config(None, tiny_train_args(bases["dense"], data, tmp_path / "run", **{"checkpoint.export_merged": "true"}))


def test_adapter_of_another_base_is_refused(runs, bases, data, tmp_path, tiny_tokenizer_dir):
    import shutil

    adapter = runs["qwen3", "dense"] / "adapter"
    # The same architecture with other weights: titanite's adapters name their base's weights.
    same_shapes = make_hf_checkpoint(tmp_path / "same-shapes", tiny_tokenizer_dir, seed=11)
    proc = run_cli("train", *lora_args(same_shapes, data, tmp_path / "run", **{"lora.adapter_path": adapter}))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "was trained on another base" in proc.stderr
    assert not (tmp_path / "run").exists()
    # Another tool's adapter (no titanite_base.json) recording a base of another architecture.
    foreign = Path(shutil.copytree(adapter, tmp_path / "foreign"))
    (foreign / "titanite_base.json").unlink()
    other = make_hf_checkpoint(tmp_path / "other", tiny_tokenizer_dir, hidden_size=64)
    proc = run_cli("train", *lora_args(other, data, tmp_path / "run2", **{"lora.adapter_path": foreign}))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "which is not the model in model.hf_path" in proc.stderr and "hidden_size" in proc.stderr


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_hf_expert_parallel_with_expert_adapters_is_refused(bases, data, tmp_path):
    with pytest.raises(UserError, match="cannot be sharded by expert parallelism"):
        from titanite.preflight import preflight

        preflight(load_config(None, lora_args(bases["moe"], data, tmp_path / "run",
                                              **{"model.spec": "hf", "parallelism.ep": 2})), world_size=2)


# -- layouts: each against one process on the same global batch ---------------------------------

LAYOUTS = {
    # name: (base, ranks, overrides)
    "fsdp": ("dense", 2, {}),
    "hf_fsdp_experts": ("moe", 2, {"model.spec": "hf"}),
    "ep": ("moe", 2, {"parallelism.ep": 2}),
    "tp": ("dense", 2, {"parallelism.tp": 2}),
    "hf_tp": ("dense", 2, {"model.spec": "hf", "parallelism.tp": 2}),
    "ep_tp": ("moe", 4, {"parallelism.ep": 2, "parallelism.tp": 2}),
    "hf_hsdp_checkpointing": ("dense", 4, {"model.spec": "hf", "parallelism.dp_replicate": 2,
                                           "parallelism.activation_checkpoint": "full"}),
    "fsdp_ep_checkpointing": ("moe", 4, {"parallelism.ep": 2, "parallelism.activation_checkpoint": "selective"}),
}


def layout_args(base: Path, data: Path, out: Path, **extra) -> list[str]:
    """8 sequences per step on any number of ranks (2 per micro-batch per rank)."""
    return lora_args(base, data, out, steps=4, **{"training.batch_size": 2, "training.global_batch_size": 8,
                                                   "checkpoint.interval": 2, **extra})


@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.slow] if LAYOUTS[n][1] > 2 else [])
                                    for n in LAYOUTS])
def test_layout_matches_one_process(layout, bases, data, tmp_path):
    from tests.test_distributed import assert_same_export, assert_same_run, torchrun

    kind, ranks, extra = LAYOUTS[layout]
    single = {k: v for k, v in extra.items() if not k.startswith("parallelism.")}
    Trainer(load_config(None, layout_args(bases[kind], data, tmp_path / "ref", **single))).train()
    proc = torchrun(ranks, layout_args(bases[kind], data, tmp_path / "run", **extra))
    if "parallelism.ep" in extra:
        assert "on this rank (ep=2)" in proc.stderr + proc.stdout
    assert_same_run(tmp_path / "ref", tmp_path / "run", [1, 2, 3, 4])
    assert_same_export(tmp_path / "ref" / "hf", tmp_path / "run" / "hf")
    # The factors, gathered from every layout's shards into peft's layout. AdamW divides each
    # element's step by its own gradient scale, so an element whose gradient is near zero moves by
    # up to ~lr on fp32 reduction-order noise alone: the factors are held to a tenth of one step
    # (lr 1e-2), the merged weights above (what the model computes with) to 1e-5.
    ref, run = (load_file(tmp_path / d / "adapter" / "adapter_model.safetensors") for d in ("ref", "run"))
    assert ref.keys() == run.keys()
    assert all(ref[k].shape == run[k].shape and (ref[k] - run[k]).abs().max().item() <= 1e-3 for k in ref)
    if layout == "fsdp":  # resharding resume: the 2-rank checkpoint at step 2, continued on 1 rank
        from tests.test_distributed import resume_dir

        out = resume_dir(tmp_path / "run", 2, tmp_path / "one")
        Trainer(load_config(None, layout_args(bases[kind], data, out, **single))).train()
        assert_same_run(tmp_path / "ref", out, [3, 4])


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_checkpointing_and_compile_train_the_same_adapters(bases, data, tmp_path, spec):
    Trainer(load_config(None, lora_args(bases["moe"], data, tmp_path / "ref", steps=3, **{"model.spec": spec}))).train()
    Trainer(load_config(None, lora_args(bases["moe"], data, tmp_path / "run", steps=3,
                                        **{"model.spec": spec, "parallelism.compile": "true",
                                           "parallelism.activation_checkpoint": "full"}))).train()
    ref, run = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "run")
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 for a, b in zip(ref, run, strict=True))


# -- the LoRA config and its tiny twin ------------------------------------------------------------

def test_lora_config_and_its_tiny_twin_share_one_structure():
    import tomllib

    from tests.conftest import REPO

    full, tiny = (tomllib.loads((REPO / "configs" / f"qwen3-4b-instruct-2507-{n}.toml").read_text())
                  for n in ("lora", "lora-tiny"))
    assert {s: sorted(t) for s, t in full.items()} == {s: sorted(t) for s, t in tiny.items()}
    assert full["lora"]["enabled"] and full["data"]["chat_loss"] == "assistant"
    load_config(str(REPO / "configs" / "qwen3-4b-instruct-2507-lora.toml"))  # valid as written


def test_tiny_lora_config_trains_on_chat_data(tmp_path):
    from peft import PeftModel

    from tests.chat_fixtures import make_chat_tokenizer, toy_conversations, write_jsonl

    base = make_hf_checkpoint(tmp_path / "base", make_chat_tokenizer(tmp_path / "tok"))
    chats = write_jsonl(tmp_path / "chat.jsonl", toy_conversations(4))
    out = tmp_path / "run"
    proc = run_cli("train", "--config", "configs/qwen3-4b-instruct-2507-lora-tiny.toml",
                   f"--model.hf_path={base}", f"--data.path={chats}", f"--eval.path={chats}",
                   f"--job.output_dir={out}", "--metrics.progress_bar=off")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainable of" in proc.stderr  # the parameter counts at start-up
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert any(k.startswith("eval") for r in rows for k in r)
    peft_model = PeftModel.from_pretrained(base_model(base), out / "adapter")
    with torch.no_grad():
        merged = base_model(out / "hf")(ids()).logits
        assert (peft_model.eval()(ids()).logits - merged).abs().max().item() <= 1e-5


@pytest.mark.parametrize("spec,targets", [("qwen3", '["all-linear"]'), ("qwen3", '["q_proj", "v_proj"]'),
                                          ("hf", '["all-linear"]')])
def test_lora_flops_per_token_are_the_matmuls_autograd_runs(bases, data, tmp_path, spec, targets):
    """MFU counts what a LoRA step computes: torch's FLOP counter over one forward + backward
    of the dense model equals the count's matmul part (the counter does not see CPU attention,
    whose FLOPs are the count's attention term)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load_config(None, lora_args(bases["dense"], data, tmp_path / "run",
                                      **{"model.spec": spec, "lora.target_modules": targets}))
    trainer = Trainer(cfg)
    a, s = trainer.handle.args, ids().shape[1]
    attention = 12 * a.num_layers * a.num_heads * a.head_dim * s
    batch = {"input_ids": ids(), "position_ids": torch.arange(s).expand(2, s), "labels": ids()}
    with FlopCounterMode(display=False) as counter:
        out = trainer.handle.forward_train(batch)
        out.loss_sum.backward()
    trainer.close()
    per_token = counter.get_total_flops() / (2 * s)
    assert per_token == pytest.approx(trainer.handle.flops_per_token(s) - attention, rel=1e-9)


def test_resume_on_a_changed_base_is_refused(bases, data, tmp_path, tiny_tokenizer_dir):
    import shutil

    base = Path(shutil.copytree(bases["dense"], tmp_path / "base"))
    out = tmp_path / "run"
    Trainer(load_config(None, lora_args(base, data, out, steps=2))).train()
    make_hf_checkpoint(base, tiny_tokenizer_dir, seed=9)  # re-saved: the same shapes, other weights
    proc = run_cli("train", *lora_args(base, data, out, steps=4))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trained on another base" in proc.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2]  # nothing lost, nothing added
    with pytest.raises(UserError, match="trained on another base"):  # nor merged onto it by an export
        export_checkpoint(training_state.latest_checkpoint(out / "checkpoints"), tmp_path / "x", 5000, merged=True)


def test_resume_with_other_lora_settings_is_refused(bases, data, tmp_path):
    out = tmp_path / "run"
    Trainer(load_config(None, lora_args(bases["dense"], data, out, steps=2))).train()
    for change in ({"lora.alpha": 16}, {"lora.target_modules": '["q_proj", "v_proj"]'}):
        with pytest.raises(UserError, match="other \\[lora\\] settings"):
            Trainer(load_config(None, lora_args(bases["dense"], data, out, steps=4, **change)))
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_adapter_with_other_alpha_or_a_broken_config_is_refused(runs, bases, data, tmp_path):
    import shutil

    adapter = runs["qwen3", "dense"] / "adapter"
    with pytest.raises(UserError, match="alpha 8 on .* alpha 16"):
        Trainer(load_config(None, lora_args(bases["dense"], data, tmp_path / "a",
                                            **{"lora.adapter_path": adapter, "lora.alpha": 16})))
    broken = Path(shutil.copytree(adapter, tmp_path / "broken"))
    config = json.loads((broken / "adapter_config.json").read_text())
    for key, value, message in (("r", 0, "r and lora_alpha must be > 0"), ("init_lora_weights", "pissa", "pissa"),
                                ("use_dora", True, "use_dora")):
        (broken / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        proc = run_cli("generate", "--model", str(broken), "--prompt", "hi", "--raw", "--max-new-tokens", "2")
        assert proc.returncode == 2 and message in proc.stderr, (key, proc.stderr[-1500:])


def test_bf16_base_and_compute_train_alike_on_both_backends(bases, data, tmp_path):
    """bf16 storage and compute (the 4B config's setting) on the MoE model, both backends: the
    expert adapters fold in the base's dtype outside autocast on both, so the backends run the
    same operations in the same dtypes and agree as closely as in fp32."""
    losses = {}
    for spec in ("qwen3", "hf"):
        out = tmp_path / spec
        Trainer(load_config(None, lora_args(bases["moe"], data, out, steps=3, **{
            "model.spec": spec, "lora.base_dtype": "bf16", "training.mixed_precision": "bf16"}))).train()
        losses[spec] = [r["loss"] for r in read_metrics(out)]
        base = load_file(bases["moe"] / "model.safetensors")
        exported = load_file(out / "hf" / "model.safetensors")
        assert all(t.dtype == torch.bfloat16 for t in exported.values())
        assert exported.keys() == base.keys()
    for a, b in zip(losses["qwen3"], losses["hf"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a)

"""The Transformers backend (`model.spec = "hf"`) against transformers' own loading and forward
(the oracle), and against the native backend trained from the same checkpoint and data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

import titanite
from tests.conftest import (
    REPO,
    TINY_MOE,
    TINY_VOCAB,
    make_hf_checkpoint,
    read_metrics,
    run_cli,
    stop_after,
    tiny_train_args,
    transformers_model,
)
from titanite.core.config import ModelConfig, load_config
from titanite.core.errors import UserError
from titanite.models.handle import handle_of
from titanite.models.spec import get_spec
from titanite.run.trainer import Trainer


def ids(shape=(2, 33), seed=1):
    return torch.randint(0, TINY_VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def train(args) -> Trainer:
    trainer = Trainer(load_config(None, args))
    trainer.train()
    return trainer


def losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def all_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# -- the model against transformers ---------------------------------------------------------

@pytest.mark.parametrize("flavor", ["debug", "debug-untied", "debug-moe-mixed"])
def test_flavor_builds_the_same_model_under_both_specs(flavor):
    """A flavor maps to the equivalent transformers config, and the same seed draws the same
    random init, so a config file runs under either spec unchanged."""
    handles = {}
    for spec_name in ("qwen3", "hf"):
        handle = get_spec(spec_name).build(ModelConfig(spec=spec_name, flavor=flavor))
        handle.module.to_empty(device="cpu")
        handle.init_buffers()
        handle.init_weights(0.02, seed=0)
        handles[spec_name] = handle
    native, hf = handles["qwen3"].module, handles["hf"].module
    assert hf.hf.config.tie_word_embeddings == native.args.tie_word_embeddings
    assert hf.hf.config.rope_parameters["rope_theta"] == native.args.rope_theta
    native_sd, hf_sd = dict(handles["qwen3"].hf_state_dict()), dict(handles["hf"].hf_state_dict())
    assert set(native_sd) == set(hf_sd)
    for key, t in native_sd.items():
        assert torch.equal(hf_sd[key], t), key
    x = torch.randint(0, 151936, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(x) - native(x)).abs().max().item() <= 1e-5


# -- traps ----------------------------------------------------------------------------------

def test_config_json_values_win_over_library_defaults(tmp_path, monkeypatch):
    # Qwen3-MoE's config class defaults router_aux_loss_coef to 0.001 and norm_topk_prob to
    # False; a config.json that states norm_topk_prob and omits the coefficient keeps both.
    folder = make_hf_checkpoint(tmp_path / "moe", **TINY_MOE, output_router_logits=True)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["router_aux_loss_coef"]
    (folder / "config.json").write_text(json.dumps(cfg))
    model = get_spec("hf").build(ModelConfig(spec="hf", hf_path=str(folder))).module
    assert transformers.AutoConfig.from_pretrained(folder).router_aux_loss_coef == 0.001  # the library default
    assert model.hf.config.router_aux_loss_coef == 0.0 and model.hf.config.norm_topk_prob is True

    # A library that drops the stated RoPE theta (the 1e4 default) is pinned back to config.json.
    import titanite.models.hf.config as hf_config

    dense = make_hf_checkpoint(tmp_path / "dense", rope_theta=5e6)
    real = transformers.AutoConfig.from_pretrained

    def forgetful(*a, **kw):
        config = real(*a, **kw)
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        return config

    monkeypatch.setattr(hf_config.AutoConfig, "from_pretrained", forgetful)
    model = titanite.load_pretrained(dense, spec="hf")
    monkeypatch.undo()
    assert model.hf.config.rope_parameters["rope_theta"] == 5e6
    x = ids()
    assert (model(x) - transformers_model(dense)(x).logits).abs().max().item() <= 1e-5


def test_tied_embeddings_stay_one_weight_through_training(tmp_path, tiny_tokenizer_dir, tiny_data):
    folder = make_hf_checkpoint(tmp_path / "tied", tiny_tokenizer_dir, tie_word_embeddings=True)
    out = tmp_path / "run"
    trainer = train(tiny_train_args(folder, tiny_data, out, steps=3, **{"model.spec": "hf"}))
    hf = trainer.model.hf
    embed = hf.get_input_embeddings().weight
    assert hf.lm_head.weight is embed
    groups = trainer.optimizer.param_groups
    in_groups = [id(p) for g in groups for p in g["params"]]
    assert len(in_groups) == len(set(in_groups)) == len(list(trainer.model.parameters()))
    assert [g["weight_decay"] for g in groups if any(p is embed for p in g["params"])] == [0.0]
    assert not torch.equal(embed, load_file(folder / "model.safetensors")["model.embed_tokens.weight"])
    assert "lm_head.weight" not in all_tensors(out / "hf")
    trainer.model.eval()
    x = ids((2, 16))
    assert (transformers_model(out / "hf")(x).logits - trainer.model(x)).abs().max().item() <= 1e-5


def _remote_code_checkpoint(tmp_path):
    folder = make_hf_checkpoint(tmp_path / "custom")
    marker = tmp_path / "remote-code-ran"
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomQwen3"}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "modeling_custom.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import Qwen3ForCausalLM\n\n\nclass CustomQwen3(Qwen3ForCausalLM):\n    pass\n")
    return folder, marker


def test_remote_code_runs_only_when_trusted(tmp_path):
    folder, marker = _remote_code_checkpoint(tmp_path)
    model = get_spec("hf").build(ModelConfig(spec="hf", hf_path=str(folder))).module
    assert type(model.hf) is transformers.Qwen3ForCausalLM and not marker.exists()
    # Trusted, in a child process so the dynamic-module cache stays under tmp_path.
    code = ("from titanite.core.config import ModelConfig; from titanite.models.spec import get_spec; "
            f"m = get_spec('hf').build(ModelConfig(spec='hf', hf_path={str(folder)!r}, trust_remote_code=True)); "
            "print(type(m.module.hf).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "CustomQwen3" and marker.read_text() == "ran"


def test_attention_and_experts_implementations_are_chosen_explicitly(tmp_path):
    dense = get_spec("hf").build(ModelConfig(spec="hf", flavor="debug")).module
    moe = get_spec("hf").build(ModelConfig(spec="hf", hf_path=str(make_hf_checkpoint(tmp_path / "m", **TINY_MOE)))).module
    assert dense.hf.config._attn_implementation == "sdpa"
    assert moe.hf.config._attn_implementation == "sdpa"
    assert moe.hf.config._experts_implementation == "grouped_mm"


def test_moe_aux_loss_follows_config_json_and_is_reported(tmp_path, tiny_tokenizer_dir, tiny_data):
    on = make_hf_checkpoint(tmp_path / "on", tiny_tokenizer_dir, **TINY_MOE, output_router_logits=True,
                            router_aux_loss_coef=0.05)
    off = make_hf_checkpoint(tmp_path / "off", tiny_tokenizer_dir, **TINY_MOE, output_router_logits=False,
                             router_aux_loss_coef=0.05)
    # Unit: the scaled aux loss is transformers' own load-balancing loss times the coefficient.
    model = titanite.load_pretrained(on, spec="hf")
    x = ids((2, 24))
    labels = torch.roll(x, -1, dims=1)
    batch = {"input_ids": x, "position_ids": torch.arange(24).expand(2, -1), "labels": labels}
    out = handle_of(model).forward_train(batch)
    ref = transformers_model(on)(x, output_router_logits=True)
    assert torch.allclose(out.aux_loss, 0.05 * ref.aux_loss, rtol=1e-5)
    ref_loss = torch.nn.functional.cross_entropy(ref.logits.flatten(0, 1), labels.flatten(), reduction="sum")
    assert out.logits is None and torch.allclose(out.loss_sum, ref_loss, rtol=1e-6)
    assert handle_of(titanite.load_pretrained(off, spec="hf")).forward_train(batch).aux_loss is None
    # In training: reported beside the loss, never inside it, and only when config.json asks.
    train(tiny_train_args(on, tiny_data, tmp_path / "run_on", steps=2, **{"model.spec": "hf"}))
    train(tiny_train_args(off, tiny_data, tmp_path / "run_off", steps=2, **{"model.spec": "hf"}))
    rows_on, rows_off = read_metrics(tmp_path / "run_on"), read_metrics(tmp_path / "run_off")
    assert all(r["aux_loss"] > 0 for r in rows_on) and all("aux_loss" not in r for r in rows_off)
    assert rows_on[0]["loss"] == pytest.approx(rows_off[0]["loss"], rel=1e-6)  # same weights at step 1
    assert rows_on[1]["loss"] != pytest.approx(rows_off[1]["loss"], rel=1e-6)  # the aux gradient was applied


def test_document_ids_keep_attention_inside_each_document(tmp_path):
    folder = make_hf_checkpoint(tmp_path / "m")
    model = titanite.load_pretrained(folder, spec="hf")
    lengths = [5, 9, 4]
    x = ids((1, sum(lengths)))
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model.run(x, pos, document_ids=docs).logits
    ref = transformers_model(folder)
    separate = torch.cat([ref(part).logits for part in x.split(lengths, dim=1)], dim=1)
    assert (packed - separate).abs().max().item() <= 1e-5


def test_native_only_settings_are_user_errors():
    with pytest.raises(UserError, match="model.moe_bias_update_rate"):
        get_spec("hf").build(ModelConfig(spec="hf", flavor="debug-moe", moe_bias_update_rate=1e-3))


def test_non_qwen3_checkpoint_is_a_user_error(tmp_path):
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(folder)
    with pytest.raises(UserError, match=r"llama.*config\.json|config\.json.*llama"):
        get_spec("hf").build(ModelConfig(spec="hf", hf_path=str(folder)))


# -- the same run under both specs ----------------------------------------------------------

PARITY = {  # checkpoint config.json overrides, run overrides, steps
    "dense": (dict(tie_word_embeddings=True), {}, 20),
    # sparse, dense and sparse layers; the aux loss on, so it is trained on and compared too
    "moe": (dict(TINY_MOE, num_hidden_layers=3, mlp_only_layers=[1], output_router_logits=True,
                 router_aux_loss_coef=0.01), {}, 20),
    # whole documents packed per window: positions restart, attention stays inside each
    "dense_packed_documents": (dict(tie_word_embeddings=False),
                               {"data.packing": "documents", "data.seq_len": 96}, 6),
}


@pytest.mark.parametrize("case", PARITY)
def test_steps_match_native_and_exports_agree(tmp_path, tiny_tokenizer_dir, tiny_data, case):
    """Same checkpoint, same data, only model.spec differs: the same loss at every step (and
    for MoE the same aux loss and expert-load metrics), and exports transformers agrees on."""
    checkpoint, extra, steps = PARITY[case]
    folder = make_hf_checkpoint(tmp_path / "src", tiny_tokenizer_dir, **checkpoint)
    runs = {}
    for spec in ("qwen3", "hf"):
        runs[spec] = tmp_path / spec
        train(tiny_train_args(folder, tiny_data, runs[spec], steps=steps,
                              **{"model.spec": spec, "checkpoint.interval": 0, **extra}))
    native, hf = read_metrics(runs["qwen3"]), read_metrics(runs["hf"])
    assert [r["step"] for r in native] == [r["step"] for r in hf] == list(range(1, steps + 1))
    compared = [k for k in native[0] if k == "loss" or k == "aux_loss" or k.startswith("moe/")]
    assert set(compared) == {k for k in hf[0] if k == "loss" or k == "aux_loss" or k.startswith("moe/")}
    assert ("aux_loss" in compared) == (case == "moe")
    for a, b in zip(native, hf, strict=True):
        for key in compared:
            assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), (a["step"], key, a[key], b[key])
    assert native[-1]["loss"] < native[0]["loss"]  # it trained
    keys = set(all_tensors(folder))
    assert set(all_tensors(runs["qwen3"] / "hf")) == set(all_tensors(runs["hf"] / "hf")) == keys
    x = ids((2, 24))
    a = transformers_model(runs["qwen3"] / "hf")(x).logits
    b = transformers_model(runs["hf"] / "hf")(x).logits
    assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item()


def test_resume_matches_uninterrupted_moe(tmp_path, tiny_tokenizer_dir, tiny_data):
    """DCP save/resume of the fused-expert, tied-head model reproduces the uninterrupted run."""
    folder = make_hf_checkpoint(tmp_path / "moe", tiny_tokenizer_dir, **TINY_MOE, tie_word_embeddings=True)
    args = lambda out: tiny_train_args(folder, tiny_data, out, steps=5, **{"model.spec": "hf"})  # noqa: E731
    full, split = tmp_path / "full", tmp_path / "split"
    train(args(full))
    first = Trainer(load_config(None, args(split)))
    head = stop_after(first, 3)
    resumed = train(args(split))
    assert resumed.model.hf.lm_head.weight is resumed.model.hf.get_input_embeddings().weight
    assert head + losses(split) == losses(full)


def test_cli_train_and_export_command(tmp_path, tiny_tokenizer_dir, tiny_data):
    folder = make_hf_checkpoint(tmp_path / "moe", tiny_tokenizer_dir, **TINY_MOE)
    out = tmp_path / "run"
    run_cli("train", *tiny_train_args(folder, tiny_data, out, steps=2, **{"model.spec": "hf"}), check=True)
    assert (out / "config.toml").read_text().count('spec = "hf"') == 1
    run_cli("export", "--checkpoint", str(out / "checkpoints" / "step-2"), "--out", str(tmp_path / "exp"),
            check=True)
    end_of_run, exported = all_tensors(out / "hf"), all_tensors(tmp_path / "exp")
    assert set(end_of_run) == set(exported) == set(all_tensors(folder))
    for key, t in end_of_run.items():
        assert torch.equal(exported[key], t), key


@pytest.mark.parametrize("mode, packing", [("selective", "stream"), ("full", "documents")])
def test_activation_checkpointing_keeps_the_losses(tmp_path, tiny_tokenizer_dir, tiny_data, mode, packing):
    """Packed documents too: the recomputation inside the backward attends within the documents
    as the forward did (their ids reach the attention as a keyword argument it keeps)."""
    folder = make_hf_checkpoint(tmp_path / "moe", tiny_tokenizer_dir, **TINY_MOE)
    for ac in ("none", mode):
        train(tiny_train_args(folder, tiny_data, tmp_path / ac, steps=3, **{
            "model.spec": "hf", "parallelism.activation_checkpoint": ac, "data.packing": packing}))
    assert losses(tmp_path / mode) == pytest.approx(losses(tmp_path / "none"), rel=1e-6)
    assert [r["grad_norm"] for r in read_metrics(tmp_path / mode)] == pytest.approx(
        [r["grad_norm"] for r in read_metrics(tmp_path / "none")], rel=1e-6)


@pytest.mark.slow
def test_fsdp_on_two_ranks_matches_one_process(tmp_path, tiny_tokenizer_dir, tiny_data):
    """torchrun + gloo, dp_shard = 2, MoE with a tied head: the same losses and export as one process."""
    folder = make_hf_checkpoint(tmp_path / "moe", tiny_tokenizer_dir, **TINY_MOE, tie_word_embeddings=True)
    common = {"model.spec": "hf", "training.global_batch_size": 4}
    one, two = tmp_path / "one", tmp_path / "two"
    train(tiny_train_args(folder, tiny_data, one, steps=4, **common))
    run_cli("--nproc_per_node=2", "-m", "titanite.train",
            *tiny_train_args(folder, tiny_data, two, steps=4, **common, **{"training.batch_size": 2}),
            module="torch.distributed.run", check=True)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    a, b = all_tensors(one / "hf"), all_tensors(two / "hf")
    assert set(a) == set(b) and "lm_head.weight" not in b
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), key

"""RoPE scaling (yarn, linear, dynamic) as transformers computes it for Qwen3, on both backends:
from config.json (transformers 5's rope_parameters or the legacy rope_scaling) and from titanite's
own `model.rope_scaling`, whose export transformers loads with the same positions; and the bad
inputs, refused with one message naming the key.

Relative error here is max |ours - transformers'| / max |transformers'| over all logits, in fp32,
on sequences of 2,048 tokens against an original length of 256, so that most positions lie
beyond original_max_position_embeddings."""

from __future__ import annotations

import json

import pytest
import torch

import titanite
from tests.conftest import TINY_MOE, TINY_VOCAB, make_hf_checkpoint, read_metrics, tiny_train_args, transformers_model
from titanite.core.config import ModelConfig, load_config
from titanite.core.errors import UserError
from titanite.models.qwen3.args import Qwen3Args, RopeScaling, from_hf_config, rope_reach
from titanite.models.spec import get_spec
from titanite.run.preflight import check_rope_reach
from titanite.run.trainer import Trainer

SEQ, ORIGINAL = 2048, 256
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL}
# name -> (config.json's RoPE keys, max_position_embeddings). "legacy" files state the scaling
# as transformers 4 wrote it: a rope_scaling dict (with "type" or "rope_type") and a top-level theta.
FILES = {
    "yarn": ({"rope_parameters": {**YARN, "rope_theta": 1e6}}, SEQ),
    "yarn_legacy": ({"rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL},
                     "rope_theta": 1e6}, SEQ),
    # every yarn field away from its default, the legacy key Qwen's model cards suggest
    "yarn_fields": ({"rope_scaling": {**YARN, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.25,
                                      "truncate": False}, "rope_theta": 1e4}, SEQ),
    "yarn_mscale": ({"rope_parameters": {**YARN, "rope_theta": 1e4, "mscale": 1.0, "mscale_all_dim": 0.5}}, SEQ),
    "linear": ({"rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}, ORIGINAL),
    "dynamic": ({"rope_parameters": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 1e6}}, ORIGINAL),
}
ARCHS = {"dense": {}, "moe": dict(TINY_MOE)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def ids(n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (1, n), generator=torch.Generator().manual_seed(1))


def checkpoint(folder, rope: dict, max_pos: int, **arch):
    """A tiny checkpoint whose config.json states `rope` (and nothing else about RoPE)."""
    make_hf_checkpoint(folder, max_position_embeddings=max_pos, **arch)

    def state(config: dict) -> None:
        for key in ("rope_parameters", "rope_scaling", "rope_theta"):
            config.pop(key, None)
        config.update(json.loads(json.dumps(rope)))

    edit(folder, state)
    return folder


def theta(rope: dict) -> float:
    return rope.get("rope_theta") or next(iter(rope.values()))["rope_theta"]


def edit(folder, change) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", FILES)
def test_logits_match_transformers_beyond_the_original_length(tmp_path, case, arch):
    rope, max_pos = FILES[case]
    folder = checkpoint(tmp_path / case, rope, max_pos, **ARCHS[arch])
    x = ids()
    with torch.no_grad():
        want = transformers_model(folder)(x).logits
        for spec in ("qwen3", "hf"):
            got = titanite.load_pretrained(folder, spec=spec)(x)
            assert rel(got, want) <= 1e-5, (spec, rel(got, want))
        # the scaling is in effect: the same weights with plain RoPE give other logits
        edit(folder, lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": theta(rope)},
                                        rope_scaling=None))
        assert rel(titanite.load_pretrained(folder)(x), want) > 1e-3


def test_dynamic_depends_only_on_each_forwards_own_length(tmp_path):
    """Dynamic NTK grows theta with a forward's longest position. transformers' module keeps the
    frequencies of the longest forward it has seen; titanite's forwards (both backends) depend
    on their own positions only, as a freshly loaded transformers model computes them."""
    folder = checkpoint(tmp_path / "m", *FILES["dynamic"])
    shorter = ids(1024)
    with torch.no_grad():
        want = transformers_model(folder)(shorter).logits
        for spec in ("qwen3", "hf"):
            model = titanite.load_pretrained(folder, spec=spec)
            model(ids())  # 2,048 positions first
            assert rel(model(shorter), want) <= 1e-5, spec


def test_legacy_and_current_files_read_alike(tmp_path):
    """transformers reads rope_scaling before rope_parameters, and theta from the top level when
    the legacy dict has none; yarn's original length defaults to max_position_embeddings."""
    base = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=1024)
    a = from_hf_config({**base, "rope_parameters": {**YARN, "rope_theta": 1e6}})
    b = from_hf_config({**base, "rope_theta": 1e6, "rope_scaling": {**YARN, "type": "yarn"},
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert a == b and a.rope_scaling == RopeScaling("yarn", 8.0, ORIGINAL)
    c = from_hf_config({**base, "rope_theta": 5e6, "rope_scaling": {"type": "yarn", "factor": 4}})
    assert c.rope_theta == 5e6 and c.rope_scaling == RopeScaling("yarn", 4.0, 1024)
    assert rope_reach(c) == 4096 and rope_reach(a) == 2048


def test_config_key_as_a_toml_table_round_trips(tmp_path):
    from titanite.core.config import to_toml

    path = tmp_path / "run.toml"
    path.write_text("[model]\nspec = 'hf'\n\n[model.rope_scaling]\nrope_type = 'yarn'\nfactor = 4.0\n"
                    "original_max_position_embeddings = 32768\n")
    cfg = load_config(path)
    assert cfg.model.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    (tmp_path / "resolved.toml").write_text(to_toml(cfg))
    assert load_config(tmp_path / "resolved.toml") == cfg
    assert load_config(None).model.rope_scaling == {}


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_config_key_extends_a_default_checkpoint_and_the_export_carries_it(tmp_path, tiny_tokenizer_dir,
                                                                         tiny_data, spec):
    """model.rope_scaling on a checkpoint of 256 positions trains at 1,024 tokens; the export's
    config.json states the scaling in transformers' form and transformers computes the same
    logits from it as titanite's model."""
    src = make_hf_checkpoint(tmp_path / "src", tiny_tokenizer_dir, max_position_embeddings=ORIGINAL)
    before = json.loads((src / "config.json").read_text())
    out = tmp_path / spec
    table = "{rope_type = 'yarn', factor = 8.0, original_max_position_embeddings = 256}"
    trainer = Trainer(load_config(None, tiny_train_args(
        src, tiny_data, out, steps=2, **{"model.spec": spec, "model.rope_scaling": table, "data.seq_len": 1024,
                                         "training.batch_size": 1, "checkpoint.interval": 0})))
    trainer.train()
    assert len(read_metrics(out)) == 2
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["rope_parameters"] == {**YARN, "rope_theta": before["rope_parameters"]["rope_theta"]}
    assert exported["rope_scaling"] == YARN  # the legacy form, for transformers 4 and vLLM on it
    assert exported["max_position_embeddings"] == SEQ  # original x factor, as transformers publishes yarn
    assert json.loads((src / "config.json").read_text()) == before  # the checkpoint is left as it was
    x = ids()
    with torch.no_grad():
        want = transformers_model(out / "hf")(x).logits
        trained = trainer.model.eval()
        assert rel(trained(x), want) <= 1e-5
        assert rel(titanite.load_pretrained(out / "hf", spec=spec)(x), want) <= 1e-5


def test_config_key_replaces_the_files_scaling(tmp_path):
    """A checkpoint already on yarn keeps its original length when model.rope_scaling only
    raises the factor; the handle's config.json has no stale legacy rope_scaling left."""
    folder = checkpoint(tmp_path / "m", FILES["yarn_legacy"][0], SEQ)
    for spec in ("qwen3", "hf"):
        handle = get_spec(spec).build(
            ModelConfig(spec=spec, hf_path=str(folder), rope_scaling={"rope_type": "yarn", "factor": 16}))
        assert handle.args.rope_scaling == RopeScaling("yarn", 16.0, ORIGINAL)
        config = handle.hf_config()
        assert config["rope_scaling"] == {**YARN, "factor": 16.0} and config["max_position_embeddings"] == 4096
        assert from_hf_config(config) == handle.args


# -- bad input ---------------------------------------------------------------------------------

FILE_ERRORS = {  # rope_parameters -> what the one message says
    "factor 1": ({**YARN, "factor": 1.0}, "'rope_parameters.factor' must be a number > 1"),
    "factor below 1": ({**YARN, "factor": 0.5}, "'rope_parameters.factor' must be a number > 1"),
    "no factor": ({"rope_type": "linear"}, "'rope_parameters.factor' is missing"),
    "unsupported type": ({"rope_type": "longrope", "factor": 2.0}, "rope type 'longrope' is not supported; "
                         "titanite computes 'default', 'linear', 'dynamic', 'yarn'"),
    "beta_fast below beta_slow": ({**YARN, "beta_fast": 1.0, "beta_slow": 4.0}, "'rope_parameters.beta_fast' (1.0)"),
    "attention_factor 0": ({**YARN, "attention_factor": 0.0},
                           "'rope_parameters.attention_factor' must be a number > 0"),
    "original 0": ({**YARN, "original_max_position_embeddings": 0},
                   "'rope_parameters.original_max_position_embeddings' must be an integer >= 1"),
    "truncate not a bool": ({**YARN, "truncate": "yes"}, "'rope_parameters.truncate' must be true or false"),
    "partial rotation": ({**YARN, "partial_rotary_factor": 0.5}, "'rope_parameters.partial_rotary_factor' must be 1"),
}


@pytest.mark.parametrize("case", FILE_ERRORS)
def test_bad_config_json_scaling_is_refused(tmp_path, case):
    params, fragment = FILE_ERRORS[case]
    folder = checkpoint(tmp_path / "m", {"rope_parameters": {**params, "rope_theta": 1e6}}, SEQ)
    with pytest.raises(UserError) as e:
        titanite.load_pretrained(folder)
    assert f"{folder}/config.json" in str(e.value) and fragment in str(e.value), str(e.value)


CONFIG_ERRORS = {  # model.rope_scaling -> what the one message says
    "factor 1": ("{rope_type = 'yarn', factor = 1.0}", "'model.rope_scaling.factor' must be a number > 1"),
    "unknown type": ("{rope_type = 'yarm', factor = 4.0}", "rope type 'yarm' is not supported"),
    "default type": ("{rope_type = 'default'}", "leave model.rope_scaling out"),
    "no type": ("{factor = 4.0}", "'model.rope_scaling.rope_type' is missing"),
    "misspelt field": ("{rope_type = 'yarn', factor = 4.0, orignal_max_position_embeddings = 256}",
                       "did you mean 'original_max_position_embeddings'"),
    "field of another type": ("{rope_type = 'linear', factor = 4.0, beta_fast = 8}", "reads no 'beta_fast'"),
    "beta_slow 0": ("{rope_type = 'yarn', factor = 4.0, beta_slow = 0}", "'model.rope_scaling.beta_slow' must be"),
    "negative theta": ("{rope_type = 'yarn', factor = 4.0, rope_theta = -1}", "'model.rope_scaling.rope_theta'"),
    "not a table": ("4.0", "'model.rope_scaling': expected dict"),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_bad_config_key_is_refused(case):
    table, fragment = CONFIG_ERRORS[case]
    with pytest.raises(UserError) as e:
        load_config(None, [f"--model.rope_scaling={table}"])
    assert fragment in str(e.value), str(e.value)


def test_seq_len_beyond_the_rope_reach_says_what_reaches_it():
    plain = Qwen3Args(max_position_embeddings=32768)
    check_rope_reach(plain, 32768)
    with pytest.raises(UserError) as e:
        check_rope_reach(plain, 131072)
    assert ("'data.seq_len' (131072) exceeds the model's max_position_embeddings (32768)" in str(e.value)
            and "model.rope_scaling = {rope_type = 'yarn', factor = 4.0, original_max_position_embeddings = 32768}"
            in str(e.value)), str(e.value)
    yarn = plain.replace(rope_scaling=RopeScaling("yarn", 4.0, 32768))
    check_rope_reach(yarn, 131072)
    with pytest.raises(UserError) as e:
        check_rope_reach(yarn, 262144)
    assert ("exceeds the 131072 positions the model's RoPE scaling reaches (yarn, factor 4.0)" in str(e.value)
            and "factor = 8.0, original_max_position_embeddings = 32768" in str(e.value)), str(e.value)
    assert rope_reach(plain.replace(rope_scaling=RopeScaling("linear", 2.0))) == 65536


def test_seq_len_beyond_the_rope_reach_exits_2(tmp_path, capsys, tiny_hf, tiny_data):
    from titanite import cli

    out = tmp_path / "run"
    code = cli.main(["train", *tiny_train_args(tiny_hf, tiny_data, out, **{"data.seq_len": 1024})])
    err = capsys.readouterr().err
    assert code == 2 and "set model.rope_scaling = {rope_type = 'yarn', factor = 2.0" in err, err[-2000:]
    assert not out.exists()

"""Config: typed overrides, validation messages that name the key, exit code 2 before any work."""

from __future__ import annotations

import tomllib

import pytest

from tests.conftest import REPO, run_cli
from titanite.core.config import Config, load_config, to_toml
from titanite.core.errors import UserError


def test_defaults_toml_and_typed_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[training]\nsteps = 7\nlr = 0.01\n[kernels]\nplugins = ["a.b"]\n"moe.experts" = "grouped_mm"\n')
    cfg = load_config(f, ["--training.lr=2e-4", "--training.mixed_precision=bf16", "--data.shuffle=false",
                          "--kernels.plugins=[\"x.y\", \"z\"]", "--job.output_dir=out dir"])
    assert cfg.training.steps == 7 and cfg.training.lr == 2e-4 and isinstance(cfg.training.lr, float)
    assert cfg.training.mixed_precision == "bf16" and cfg.data.shuffle is False
    assert cfg.kernels.plugins == ["x.y", "z"] and cfg.kernels.select == {"moe.experts": "grouped_mm"}
    assert cfg.job.output_dir == "out dir"
    # The written TOML reads back to the same config.
    assert load_config_from_text(tmp_path, to_toml(cfg)) == cfg


def load_config_from_text(tmp_path, text: str) -> Config:
    p = tmp_path / "round.toml"
    p.write_text(text)
    return load_config(p)


def test_contract_keys_exist():
    cfg = Config()
    for dotted in ["job.output_dir", "job.seed", "model.spec", "model.flavor", "model.hf_path",
                   "training.steps", "training.lr", "training.batch_size", "training.mixed_precision",
                   "data.path", "data.seq_len", "checkpoint.interval", "checkpoint.export_hf",
                   "metrics.log_interval", "parallelism.dp_shard", "parallelism.tp", "parallelism.ep",
                   "kernels.plugins"]:
        section, key = dotted.split(".")
        assert hasattr(getattr(cfg, section), key), dotted


@pytest.mark.parametrize("override, fragment", [
    ("--training.lrr=1", "unknown config key 'training.lrr' (did you mean 'lr'?)"),
    ("--trainig.lr=1", "unknown config section '[trainig]' (did you mean 'training'?)"),
    ("--training.steps=ten", "config key 'training.steps': expected int, got 'ten'"),
    ("--training.steps=0", "config key 'training.steps' must be > 0"),
    ("--training.mixed_precision=fp8", "config key 'training.mixed_precision': 'fp8' is not one of"),
    ("--model.spec=hff", "(did you mean 'hf'?)"),
    ("--data.shuffle=maybe", "config key 'data.shuffle': expected bool"),
    ("--parallelism.dp_shard=0", "parallelism.dp_shard"),
    ("--checkpoint.async_mode=background", "config key 'checkpoint.async_mode': 'background' is not one of"),
    ("training.lr=1", "bad override 'training.lr=1'"),
])
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(UserError) as e:
        load_config(None, [override])
    assert fragment in str(e.value)


def test_bad_toml_file_names_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[training\nsteps = 1\n")
    with pytest.raises(UserError, match="bad.toml is not valid TOML"):
        load_config(f)
    f.write_text("[training]\nstep = 1\n")
    with pytest.raises(UserError, match=r"'training.step' \(did you mean 'steps'\?\)"):
        load_config(f)


def test_cli_exits_2_before_any_work(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--config", "configs/demo.toml", f"--job.output_dir={out}", "--training.lrr=1")
    assert proc.returncode == 2
    assert "unknown config key 'training.lrr' (did you mean 'lr'?)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()  # nothing written


def test_help_config_lists_every_key():
    proc = run_cli("train", "--help-config", check=True)
    assert "[training]" in proc.stdout and "global_batch_size" in proc.stdout and "RoPE" not in proc.stderr
    parsed_sections = {line.strip("[]") for line in proc.stdout.splitlines() if line.startswith("[")}
    assert parsed_sections == set(tomllib.loads(to_toml(Config())))


def test_every_help_that_points_to_the_docs_has_its_section_there():
    """A key whose short help says 'docs/config.md' is explained there under its own heading."""
    import dataclasses

    docs = (REPO / "docs" / "config.md").read_text()
    pointing = [f"{section}.{f.name}" for section, value in vars(Config()).items() if dataclasses.is_dataclass(value)
                for f in dataclasses.fields(value) if "docs/config.md" in f.metadata.get("help", "")]
    assert len(pointing) >= 9
    missing = [key for key in pointing if f"## `{key}`" not in docs]
    assert not missing, f"no section in docs/config.md for {missing}"

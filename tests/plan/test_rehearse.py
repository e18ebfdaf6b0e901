"""`titanite estimate --rehearse`: the real parallel plan on the meta device under a fake
process group, against the analytic estimate (parameters, gradients and optimizer state within
5%) and against what a real multi-process run stores.

The rehearsal starts and destroys its own fake process group, so these run in the test process
(no real process group is ever started here)."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO, run_cli
from titanite.core.config import load_config
from titanite.models.qwen3.args import to_hf_config
from titanite.models.qwen3.flavors import get_flavor
from titanite.plan import estimate
from titanite.plan.rehearse import fitting_layout, rehearse

LAYOUTS = {
    # name: (world size, overrides)
    "one process": (1, {}),
    "fsdp 4": (4, {}),
    "hsdp 2x2": (4, {"parallelism.dp_replicate": 2}),
    "tp 2": (2, {"parallelism.tp": 2}),
    "fsdp 2 x tp 2": (4, {"parallelism.tp": 2}),
    "fsdp 4 + ep 2": (4, {"parallelism.ep": 2}),
}
MODELS = {"dense": "debug", "moe": "debug-moe"}


def _cfg(flavor: str, spec: str, **extra) -> object:
    opts = {"model.flavor": flavor, "model.spec": spec, "training.batch_size": 1, "data.seq_len": 64, **extra}
    return load_config(None, [f"--{k}={v}" for k, v in opts.items()])


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 0.05 * max(abs(b), 1)


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
@pytest.mark.parametrize("layout,kind", [(layout, kind) for layout in LAYOUTS for kind in MODELS
                                         if kind == "moe" or "parallelism.ep" not in LAYOUTS[layout][1]])
def test_rehearsal_agrees_with_the_estimate(layout, kind, spec):
    world, extra = LAYOUTS[layout]
    cfg = _cfg(MODELS[kind], spec, **extra)
    e = estimate(cfg, world)
    for f in rehearse(cfg, world):
        assert _close(f.params, e.params) and _close(f.grads, e.grads) and _close(f.optimizer, e.optimizer), \
            (layout, f, e.params, e.grads, e.optimizer)
        assert f.params < f.startup_peak < f.params + 4 * cfg_numel(cfg)  # shards + one tensor, not the model


def test_rehearsal_counts_a_lora_run(tmp_path):
    """Frozen base: no gradients or optimizer state but the adapters', as the estimate counts."""
    import transformers

    folder = tmp_path / "base"
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)).save_pretrained(folder)
    cfg = load_config(None, [f"--model.hf_path={folder}", "--lora.enabled=true", "--lora.rank=4",
                             "--training.batch_size=1", "--data.seq_len=32", "--parallelism.tp=2"])
    e = estimate(cfg, 4)
    (f0, f3) = rehearse(cfg, 4)
    for f in (f0, f3):
        assert _close(f.params, e.params) and _close(f.grads, e.grads) and _close(f.optimizer, e.optimizer)
        assert f.grads * 4 < f.params  # only adapters train
        # 2 x FSDP x 2 x TP: a rank reads a quarter of the sharded weights, the replicated norms whole
        whole = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        assert whole / 4.05 <= f.checkpoint_read < whole / 3  # the file also holds its header


def cfg_numel(cfg) -> int:
    from titanite.models.spec import get_spec

    return sum(p.numel() for p in get_spec(cfg.model.spec).build(cfg.model).module.parameters())


SEEDS = {"seed-native": "8B", "seed-hf": "8B", "seed-moe-kernels": "30B-A3B"}


@pytest.mark.slow
@pytest.mark.parametrize("config,world", [*((s, 8) for s in SEEDS), ("seed-moe-kernels", 64),
                                          ("seed-moe-kernels", 256)])
def test_seed_configs_and_235b_rehearse_on_this_cpu(config, world):
    """Every seed config at its size on 8 ranks, and Qwen3-235B-A22B on 64 and 256 (the seed's
    own layout, ep = 8): the checkpoints are not here, so the flavor gives the architecture."""
    flavor = "235B-A22B" if world > 8 else SEEDS[config]
    cfg = load_config(str(REPO / "configs" / f"{config}.toml"), ["--model.hf_path=", f"--model.flavor={flavor}"])
    e = estimate(cfg, world)
    for f in rehearse(cfg, world):
        assert _close(f.params, e.params) and _close(f.grads, e.grads) and _close(f.optimizer, e.optimizer)


def test_rehearse_command_names_a_layout_that_fits():
    proc = run_cli("estimate", "--config", "configs/seed-moe-kernels.toml", "--world-size", "64", "--rehearse",
                   "--device-memory-gib", "80", "--model.hf_path=", "--model.flavor=235B-A22B", "--metrics.peak_tflops=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"rehearsal / estimate: parameters 1\.0\d\d, gradients 1\.0\d\d, optimizer 1\.0\d\d", out), out
    assert "does not fit 80 GiB; this layout would: " in out
    assert "does not start on" not in out  # start-up holds the shards and one tensor, not the model


@pytest.mark.parametrize("gib", [1.0, 40.0])
def test_a_suggested_layout_is_one_the_config_accepts(tmp_path, gib):
    """LoRA with dropout refuses tensor parallelism: the search passes over tp > 1 instead of
    failing on it, and names only a tp = 1 layout (or none). The 4B base is its config.json."""
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(get_flavor("4B"))))
    cfg = load_config(str(REPO / "configs" / "qwen3-4b-instruct-2507-lora.toml"), [f"--model.hf_path={tmp_path}"])
    assert cfg.lora.dropout > 0
    found = fitting_layout(cfg, 8, gib)
    assert (found is None) == (gib == 1.0), found
    assert found is None or ", tp = 1, " in found

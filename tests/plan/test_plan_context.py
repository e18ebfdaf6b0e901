"""The planner under context parallelism (`parallelism.cp`): `titanite estimate` counts each
rank's S / cp tokens, the gathered keys and values, their gradients and the shared mask, shards
FSDP over dp_shard x cp, reports the CP communication per step, names a layout with the cp that
fits a sequence length, and `--rehearse` builds the real plan with a cp mesh dim.

The per-token counts are held to the estimate's own counts at cp = 1 for half (a quarter) of
the sequence, the CP buffers to the shapes the attention gathers, the long config to 80 GB.
Everything here is built on the meta device: no weights, no process group but the rehearsal's
fake one."""

from __future__ import annotations

import json
import tomllib

import pytest

from tests.conftest import REPO
from titanite.cli import main as cli_main
from titanite.core.config import load_config
from titanite.models.qwen3.args import to_hf_config
from titanite.models.qwen3.flavors import get_flavor
from titanite.plan import estimate
from titanite.plan.context import add_context
from titanite.plan.counts import GiB
from titanite.plan.rehearse import fitting_layout, rehearse

LONG, LONG_TINY = (REPO / "configs" / f"qwen3-4b-instruct-2507-{n}.toml" for n in ("long", "long-tiny"))


def _cfg(seq_len: int, cp: int, flavor: str = "debug", **extra) -> object:
    opts = {"model.flavor": flavor, "training.batch_size": 2, "data.seq_len": seq_len, "parallelism.cp": cp,
            "kernels.loss": "chunked", **extra}
    return load_config(None, [f"--{k}={v}" for k, v in opts.items()])


@pytest.fixture(scope="module")
def qwen3_4b(tmp_path_factory):
    """A folder with Qwen3-4B-Instruct-2507's config.json (the estimate reads no weights)."""
    folder = tmp_path_factory.mktemp("qwen3-4b")
    (folder / "config.json").write_text(json.dumps(to_hf_config(get_flavor("4B-2507"))))
    return folder


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("cp", [2, 4])
def test_per_rank_counts_are_those_of_the_rank_share_of_the_sequence(ac, cp):
    """cp ranks of one sequence of S tokens each count what one rank counts for S / cp tokens
    (same FSDP degree: world cp against dp_shard cp), plus the CP buffers; and at the same S,
    1 / cp of the per-token activations of cp = 1."""
    S, world = 512, cp
    split = estimate(_cfg(S, cp, **{"parallelism.activation_checkpoint": ac}), world, on_gloo=False)
    share = estimate(_cfg(S // cp, 1, **{"parallelism.activation_checkpoint": ac}), world, on_gloo=False)
    whole = estimate(_cfg(S, 1, **{"parallelism.activation_checkpoint": ac}), world, on_gloo=False)
    assert split.dims.fsdp_shard == share.dims.fsdp_shard == world
    for part in ("params", "grads", "optimizer", "activations", "recompute", "transient"):
        assert getattr(split, part) == pytest.approx(getattr(share, part), rel=1e-12), part
    assert split.phases == pytest.approx(add_context(share.phases, split.context), rel=1e-12)
    assert split.activations == pytest.approx(whole.activations / cp, rel=1e-12)
    assert split.tokens_per_step == whole.tokens_per_step // cp  # the batch is dp's: cp does not multiply it
    assert split.flops_per_step == pytest.approx(whole.flops_per_step / cp, rel=1e-12)
    assert share.context is None and whole.context is None  # no CP buffers, no mask at cp = 1


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_the_cp_buffers_are_the_gathered_keys_values_and_one_mask(ac):
    """[B, Hk, S, D] keys and values per layer in the compute dtype: every layer's kept without
    checkpointing, one layer's rebuilt with it, their gradients one layer at a time; the mask
    (additive, compute dtype) is B x c x (2cp + 1) c values for packed documents, c x (2cp + 1) c
    for plain causal rows."""
    cp, S, B = 4, 512, 2
    a = get_flavor("debug")
    kv_layer = 2 * B * a.num_kv_heads * S * a.head_dim * 4  # fp32: mixed_precision none
    c = S // (2 * cp)
    for packing, rows in (("documents", B), ("stream", 1)):
        e = estimate(_cfg(S, cp, **{"parallelism.activation_checkpoint": ac, "data.packing": packing}), 8,
                     on_gloo=False)
        x = e.context
        assert (x.kept, x.recompute) == ((a.num_layers * kv_layer, 0) if ac == "none" else (0, kv_layer))
        assert x.gradients == kv_layer and x.mask == rows * c * (2 * cp + 1) * c * 4
    bf16 = estimate(_cfg(S, cp, **{"training.mixed_precision": "bf16", "data.packing": "documents"}), 8,
                    on_gloo=False)
    assert bf16.context.kv_layer == kv_layer / 2 and bf16.context.mask == B * c * (2 * cp + 1) * c * 2


def test_fsdp_shards_over_dp_shard_times_cp():
    """cp ranks are FSDP ranks: cp = 4 on 4 ranks (dp_shard = 1) shards the states 4 ways and
    gathers blocks as FSDP over 4 does; cp = 2 on 8 ranks shards them as dp_shard = 8 does."""
    fsdp4, cp4 = (estimate(_cfg(512, cp), 4, on_gloo=False) for cp in (1, 4))
    assert cp4.dims.dp_shard == 1 and cp4.dims.fsdp_shard == 4
    assert (cp4.params, cp4.grads, cp4.optimizer, cp4.transient) == \
           (fsdp4.params, fsdp4.grads, fsdp4.optimizer, fsdp4.transient)
    single = estimate(_cfg(512, 1), 1, on_gloo=False)
    assert cp4.params < single.params / 3.5 and cp4.transient > 0
    fsdp8, cp2 = (estimate(_cfg(512, cp), 8, on_gloo=False) for cp in (1, 2))
    assert cp2.params == fsdp8.params and cp2.phases["optimizer step"] == \
           pytest.approx(fsdp8.phases["optimizer step"] + cp2.context.mask)


def test_the_report_names_the_split_and_the_cp_communication(capsys):
    """Per layer and micro-batch: the forward's all-gather receives (cp - 1) / cp of the gathered
    keys and values, checkpointing gathers again, backward reduce-scatters the gradients."""
    args = ["--model.flavor=debug", "--data.seq_len=512", "--training.batch_size=2", "--parallelism.cp=2",
            "--world-size", "4", "--training.global_batch_size=8"]
    assert cli_main(["estimate", *args]) == 0
    out = capsys.readouterr().out
    assert "layout: 4 ranks (dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1)" in out
    assert "each rank holds 256 of every sequence's 512 tokens" in out
    assert "CP communication per step per rank" in out and "CP: attention mask" in out
    for ac, collectives in (("none", 2), ("full", 3)):
        e = estimate(_cfg(512, 2, **{"parallelism.activation_checkpoint": ac, "training.global_batch_size": 8}), 4,
                     on_gloo=False)
        assert e.context.micro_batches == 2  # 8 sequences over 2 data-parallel ranks of 2 each
        layers = get_flavor("debug").num_layers
        assert e.context.communication == e.context.kv_layer / 2 * collectives * layers * 2
        assert f"{e.context.communication:.3e} bytes" in e.context.describe(512)


def test_the_long_config_fits_80gb_only_with_its_cp(qwen3_4b):
    """The 65,536-token chat config on 8 ranks: its cp (the smallest that fits) fits 80 GiB by the
    estimate, half of it and cp = 1 do not; the layout search names that cp for a cp = 1 config."""
    cfg = load_config(str(LONG), [f"--model.hf_path={qwen3_4b}"])
    assert cfg.data.seq_len == 65536 and cfg.data.packing == "documents" and cfg.training.mixed_precision == "bf16"
    cp = cfg.parallelism.cp

    def peak(c: int) -> float:
        trial = load_config(str(LONG), [f"--model.hf_path={qwen3_4b}", f"--parallelism.cp={c}"])
        return estimate(trial, 8, on_gloo=False, device_memory=80 * GiB).total / GiB

    assert cp > 1 and peak(cp) < 80 < min(peak(cp // 2), peak(1))
    one = load_config(str(LONG), [f"--model.hf_path={qwen3_4b}", "--parallelism.cp=1"])
    found = fitting_layout(one, 8, 80.0, on_gloo=False)
    assert found is not None and f"cp = {cp}, tp = 1," in found, found


def test_the_estimate_command_names_the_cp_that_fits(capsys, qwen3_4b):
    out_fit = []
    for cp in (1, 4):
        assert cli_main(["estimate", "--config", str(LONG), "--world-size", "8", "--device-name", "H100",
                         f"--model.hf_path={qwen3_4b}", f"--parallelism.cp={cp}"]) == 0
        out_fit.append(capsys.readouterr().out)
    assert "does not fit 80 GiB; this layout would: dp_shard = 2, cp = 4, tp = 1" in out_fit[0]
    assert "fits 80 GiB" in out_fit[1] and "does not fit" not in out_fit[1]


def test_the_tiny_twin_is_the_long_config_on_two_ranks(tmp_path):
    """Same sections and keys; cp = 2 on a world of 2, a few thousand tokens; its estimate splits
    the sequence over both ranks."""
    full, tiny = (tomllib.loads(p.read_text()) for p in (LONG, LONG_TINY))
    assert {s: sorted(t) for s, t in full.items()} == {s: sorted(t) for s, t in tiny.items()}
    assert tiny["parallelism"]["cp"] == 2 and 1024 <= tiny["data"]["seq_len"] <= 8192
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(get_flavor("debug"))))
    cfg = load_config(str(LONG_TINY), [f"--model.hf_path={tmp_path}"])
    e = estimate(cfg, 2)
    assert e.dims.describe() == "2 ranks (dp_replicate=1, dp_shard=1, cp=2, tp=1, ep=1)"
    assert e.context.local_tokens == cfg.data.seq_len // 2


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 0.05 * max(abs(b), 1)


@pytest.mark.parametrize("world,extra", [
    (8, {}),
    (8, {"parallelism.tp": 2}),
    (8, {"parallelism.dp_replicate": 2}),
    (8, {"parallelism.ep": 2, "model.flavor": "debug-moe"}),
    (8, {"parallelism.ep": 2, "parallelism.dp_replicate": 2, "model.flavor": "debug-moe"}),
])
def test_the_rehearsal_runs_with_cp(world, extra):
    """The real plan under the fake process group with a cp mesh dim (FSDP over dp_shard x cp):
    each rank's shards agree with the estimate."""
    cfg = _cfg(512, 2, **extra)
    e = estimate(cfg, world)
    for f in rehearse(cfg, world):
        assert _close(f.params, e.params) and _close(f.grads, e.grads) and _close(f.optimizer, e.optimizer), \
            (extra, f, e.params)


def test_the_default_world_counts_cp(capsys):
    """Without --world-size the estimate takes the smallest world the layout allows: cp ranks too."""
    from titanite.commands.estimate import smallest_world

    p = _cfg(512, 2, **{"parallelism.tp": 2}).parallelism
    assert smallest_world(p) == 4
    assert cli_main(["estimate", "--model.flavor=debug", "--data.seq_len=512", "--parallelism.cp=4"]) == 0
    assert "world size: 4 (the smallest the layout allows" in capsys.readouterr().out

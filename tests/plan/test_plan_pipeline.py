"""The planner under pipeline parallelism (`parallelism.pp`): `titanite estimate` counts each
pipeline rank's stages, the micro-batches its schedule keeps in flight, the bubble and the
point-to-point traffic, and `--rehearse` builds the real stages under the fake process group.

Each count is held to something computed another way: the states to the rehearsal's real shards,
the micro-batches in flight to the order torch's own schedule classes build, the bubble to the
textbook formula, the split to a brute-force search, the per-stage activations to the estimate
without pipelining, and the tiny twin of configs/qwen3-235b-a22b-pretrain.toml trained with pp = 2
on 2 ranks to the same config on one process."""

from __future__ import annotations

import itertools
import json
import re
import tomllib
import types

import pytest
from torch.distributed.pipelining.schedules import _ComputationType, get_schedule_class

from tests.conftest import REPO, read_metrics
from tests.parallel.test_distributed import assert_same_run, torchrun
from titanite.cli import main as cli_main
from titanite.core.config import load_config
from titanite.models.qwen3.args import to_hf_config
from titanite.models.qwen3.flavors import get_flavor
from titanite.parallel.pipeline_layout import SCHEDULES, PipelineLayout, balanced_split, stage_costs
from titanite.plan import estimate
from titanite.plan.counts import GiB
from titanite.plan.pipeline_costs import in_flight
from titanite.plan.rehearse import fitting_layout, rehearse

PRETRAIN, PRETRAIN_TINY = (REPO / "configs" / f"qwen3-235b-a22b-pretrain{s}.toml" for s in ("", "-tiny"))


def _cfg(world_extra: dict, flavor: str = "debug-moe-untied") -> object:
    opts = {"model.flavor": flavor, "training.batch_size": 1, "data.seq_len": 64, "training.global_batch_size": 16,
            **world_extra}
    return load_config(None, [f"--{k}={v}" for k, v in opts.items()])


@pytest.fixture(scope="module")
def untied_moe(tmp_path_factory):
    """The debug-moe-untied flavor as a config.json folder (LoRA adapts a model.hf_path)."""
    folder = tmp_path_factory.mktemp("debug-moe-untied")
    (folder / "config.json").write_text(json.dumps(to_hf_config(get_flavor("debug-moe-untied"))))
    return folder


# -- micro-batches in flight, against the order torch's schedules build ---------------------------

def _schedule_order(layout: PipelineLayout) -> dict[int, list]:
    """The per-rank action order torch's schedule class for `layout` builds (every rank's, built
    on any one: stand-in stages carry only what the order needs)."""
    def stage(k: int):
        return types.SimpleNamespace(stage_index=k, num_stages=layout.num_stages, group_size=layout.pp, group_rank=0,
                                     is_first=k == 0, is_last=k == layout.num_stages - 1, submod=None)

    stages = [stage(k) for k in layout.stages_of(0)]
    cls = get_schedule_class(layout.schedule.name)
    return cls(stages[0] if len(stages) == 1 else stages, layout.microbatches, loss_fn=lambda out, target: out
               ).pipeline_order


def _most_held(actions: list) -> int:
    """Walk one rank's actions: a micro-batch's activations on a stage live from its forward to its
    full backward, or to its weight-gradient step where the backward is split; a forward overlapped
    with a backward (one action of two) runs beside it."""
    held = most = 0

    def act(a) -> None:
        nonlocal held, most
        for sub in a.sub_actions or ():
            act(sub)
        held += {_ComputationType.FORWARD: 1, _ComputationType.FULL_BACKWARD: -1,
                 _ComputationType.BACKWARD_WEIGHT: -1}.get(a.computation_type, 0)
        most = max(most, held)

    for a in actions:
        if a is not None:
            act(a)
    return most


def _cases():
    for name, s in SCHEDULES.items():
        looped = s.stages_per_rank > 1 and not s.v_shape
        for v, pp in itertools.product((s.stages_per_rank, 3) if looped else (s.stages_per_rank,), (2, 3, 4, 8)):
            for n in (pp, pp + 1, 2 * pp, 3 * pp):
                if (v == 1 or n % pp == 0) and (name != "DualPipeV" or n >= 2 * pp) and v * pp <= 24:
                    yield name, v, pp, n


@pytest.mark.parametrize("name,v,pp,n", list(_cases()))
def test_in_flight_is_what_the_schedule_order_holds(name, v, pp, n):
    layout = PipelineLayout(pp, SCHEDULES[name], n, (1,) * (pp * v), v)
    order = _schedule_order(layout)
    assert [in_flight(layout, r) for r in range(pp)] == [_most_held(order[r]) for r in range(pp)]


# -- the bubble and the split ----------------------------------------------------------------------

def test_bubble_is_the_textbook_fraction():
    """(pp - 1) / (n + pp - 1) for one stage per rank (Narayanan et al. 2021), the warm-up shrunk
    by v for interleaved stages, and to a third for zero bubble: pp 4, 8 micro-batches."""
    assert SCHEDULES["1F1B"].bubble(4, 8) == pytest.approx(3 / 11)
    assert SCHEDULES["GPipe"].bubble(4, 8) == pytest.approx(3 / 11)
    assert SCHEDULES["Interleaved1F1B"].bubble(4, 8) == pytest.approx(1.5 / 9.5)
    assert SCHEDULES["InterleavedZeroBubble"].bubble(4, 8) == pytest.approx(0.5 / 8.5)
    assert SCHEDULES["1F1B"].bubble(1, 8) == 0.0


def _best_max_cost(costs: list[float], stages: int, first: float, last: float) -> float:
    """The least possible cost of the most expensive stage, by trying every cut."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[bounds[k]:bounds[k + 1]]) + (first if k == 0 else 0) + (last if k == stages - 1 else 0)
                    for k in range(stages))
        best = min(best, worst)
    return best


def test_balanced_split_is_the_best_cut():
    assert balanced_split([1.0] * 8, 4) == [2, 2, 2, 2]
    heavy_head = balanced_split([1.0] * 9, 3, last=2.0)
    assert heavy_head[-1] < heavy_head[0] and sum(heavy_head) == 9
    costs, first, last = stage_costs(get_flavor("235B-A22B"), 4096)
    sizes = balanced_split(costs, 4, first, last)
    assert sum(sizes) == 94 and sizes[-1] < sizes[0]  # the head costs the last stage some blocks
    bounds = [0, *itertools.accumulate(sizes)]
    worst = max(sum(costs[bounds[k]:bounds[k + 1]]) + (first if k == 0 else 0) + (last if k == 3 else 0)
                for k in range(4))
    assert worst == pytest.approx(_best_max_cost(costs, 4, first, last), rel=1e-12)


# -- states: the estimate of each pipeline rank against its real stages ----------------------------

REHEARSED = {
    "pp 2": (2, {"parallelism.pp": 2}),
    "pp 2 x fsdp 2 + ep 2": (4, {"parallelism.pp": 2, "parallelism.ep": 2}),
    "pp 2 x tp 2": (4, {"parallelism.pp": 2, "parallelism.tp": 2}),
    "pp 2 x fsdp 2 x tp 2 + ep 2": (8, {"parallelism.pp": 2, "parallelism.tp": 2, "parallelism.ep": 2}),
    "pp 2 interleaved x fsdp 2": (4, {"parallelism.pp": 2, "parallelism.pp_schedule": "Interleaved1F1B"}),
    "pp 2 looped x hsdp 2": (4, {"parallelism.pp": 2, "parallelism.pp_schedule": "LoopedBFS",
                                 "parallelism.dp_replicate": 2}),
    # zero-bubble schedules run without data parallelism (refused with FSDP): V placement over tp
    "pp 2 zbv x tp 2": (4, {"parallelism.pp": 2, "parallelism.pp_schedule": "ZBVZeroBubble", "parallelism.tp": 2}),
    "pp 4 gpipe x fsdp 2": (8, {"parallelism.pp": 4, "parallelism.pp_schedule": "GPipe"}),
    "pp 2 dualpipev": (2, {"parallelism.pp": 2, "parallelism.pp_schedule": "DualPipeV"}),
    "pp 2 lora x fsdp 2": (4, {"parallelism.pp": 2, "lora.enabled": "true", "lora.rank": 4}),
}


@pytest.mark.parametrize("layout", REHEARSED)
def test_each_pipeline_rank_states_are_its_real_stages(layout, untied_moe):
    """Parameters, gradients and optimizer state of every pipeline rank, to the byte, as the
    rehearsal reads them from the stages the real plan leaves that rank (FSDP's padding included;
    a LoRA run's frozen base and trained adapters)."""
    world, extra = REHEARSED[layout]
    cfg = _cfg({**extra, "model.hf_path": untied_moe} if "lora.enabled" in extra else extra)
    e = estimate(cfg, world)
    pp = e.pipeline.layout.pp
    ranks = sorted({r * (world // pp) for r in range(pp)} | {world - 1})
    figures = rehearse(cfg, world, ranks)
    assert sorted({f.pp_rank for f in figures}) == list(range(pp))
    for f in figures:
        params, grads, optimizer = e.pipeline.ranks[f.pp_rank].memory[:3]
        assert (f.params, f.grads, f.optimizer) == (params, grads, optimizer), (layout, f)


# -- activations and traffic -----------------------------------------------------------------------

@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("tp", [1, 2])
def test_stage_activations_add_up_to_the_whole_model(ac, tp, lora, untied_moe):
    """Under 1F1B each rank runs one stage; a micro-batch's activations over the stages are the
    whole model's without pipelining, plus, at each of the 3 stage boundaries, the output the
    earlier stage holds for its backward and the RoPE tables the later stage builds for itself
    (a LoRA run's adapters' values and effective expert weights included)."""
    extra = {"parallelism.activation_checkpoint": ac, "parallelism.tp": tp, "training.global_batch_size": 8}
    if lora:
        extra.update({"lora.enabled": "true", "lora.rank": 4, "model.hf_path": untied_moe})
    piped = estimate(_cfg({**extra, "parallelism.pp": 4}), 4 * tp, on_gloo=False)
    whole = estimate(_cfg(extra), tp, on_gloo=False)
    ranks = piped.pipeline.ranks
    assert [r.in_flight for r in ranks] == [4, 3, 2, 1]
    per_micro_batch = sum(r.memory[3] / r.in_flight for r in ranks)
    rope = 2 * get_flavor("debug-moe-untied").head_dim * 64 * 4  # cos and sin, 64 tokens, fp32
    assert per_micro_batch == pytest.approx(whole.activations + 3 * (piped.pipeline.boundary + rope), rel=1e-12)
    assert max(r.memory[4] for r in ranks) == pytest.approx(whole.recompute, rel=1e-12)


@pytest.mark.parametrize("flavor,tp,counting", [("debug-untied", 1, False), ("debug-moe-untied", 1, True),
                                                ("debug-moe-untied", 2, True)])
def test_point_to_point_bytes(flavor, tp, counting):
    """One micro-batch's hidden states across a boundary: 2 x 64 tokens x 128 values x 4 bytes
    (fp32), halved by sequence parallelism under tp 2; 4 micro-batches a step each way, the
    forward twice where the MoE balancing loss runs its counting pass."""
    cfg = _cfg({"parallelism.pp": 2, "parallelism.tp": tp, "training.batch_size": 2, "training.global_batch_size": 8},
               flavor)
    e = estimate(cfg, 2 * tp, on_gloo=False)
    boundary = 2 * 64 * 128 * 4 / tp
    assert e.pipeline.boundary == boundary and e.pipeline.counting == counting
    assert [r.p2p_bytes for r in e.pipeline.ranks] == [4 * boundary * (2 if counting else 1), 4 * boundary]


def test_the_estimate_command_reports_the_pipeline(capsys):
    args = ["estimate", "--model.flavor=debug-moe-untied", "--data.seq_len=64", "--training.batch_size=1",
            "--training.global_batch_size=8", "--parallelism.pp=2", "--world-size", "4", "--rehearse"]
    assert cli_main([*args, "--parallelism.pp_microbatches=2"]) == 0
    out = capsys.readouterr().out
    sizes = list(estimate(load_config(None, [a for a in args[1:] if a.startswith("--") and "=" in a]), 4
                          ).pipeline.layout.sizes)
    assert "layout: 4 ranks (pp=2, dp_replicate=1, dp_shard=2, tp=1, ep=1)" in out
    assert (f"pipeline: pp=2, 1F1B, 2 stages (1 per rank) of {sizes} layers, 2 micro-batches per pass, 2 passes "
            "per step (after a forward-only counting pass: the MoE balancing loss)") in out
    assert "bubble 33.3% of each step" in out  # (2 - 1) / (2 + 2 - 1)
    assert f"pp rank 0: stage 0 (layers 0-{sizes[0] - 1}, embedding): 2 micro-batch-stages in flight" in out
    last = "layer 3" if sizes[1] == 1 else f"layers {sizes[0]}-3"
    assert f"pp rank 1: stage 1 ({last}, norm + head): 1 micro-batch-stage in flight" in out
    for rank, pp_rank in ((0, 0), (3, 1)):
        assert f"rank {rank} (pp rank {pp_rank}) rehearsal / estimate: parameters 1.000, gradients 1.000, " \
               "optimizer 1.000" in out


# -- the 235B-A22B pretraining config and its tiny twin --------------------------------------------

@pytest.fixture(scope="module")
def pretrain_folder(tmp_path_factory):
    """What the config's model.hf_path holds: Qwen3-235B-A22B's config.json, the balancing loss on."""
    folder = tmp_path_factory.mktemp("qwen3-235b-a22b-pretrain")
    hf = to_hf_config(get_flavor("235B-A22B"))
    hf["output_router_logits"] = True
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


def test_the_pretrain_config_fits_80gb_on_its_world(pretrain_folder):
    """Its layout on the world its header names fits 80 GiB by the estimate, with the rehearsed
    states of the first and the last rank equal to the estimate's."""
    text = PRETRAIN.read_text()
    cfg = load_config(str(PRETRAIN), [f"--model.hf_path={pretrain_folder}"])
    world = int(text.split("--world-size ")[1].split()[0])
    assert cfg.model.aux_loss_scope == "global_batch" and cfg.parallelism.pp > 1 and cfg.data.seq_len == 4096
    e = estimate(cfg, world, on_gloo=False, device_memory=80 * GiB)
    assert e.total <= 80 * GiB and e.pipeline.counting  # the balancing loss is trained: a counting pass
    for f in rehearse(cfg, world):
        assert (f.params, f.grads, f.optimizer) == e.pipeline.ranks[f.pp_rank].memory[:3]


def test_the_layout_search_tries_pipeline_stages(pretrain_folder):
    """At 256 ranks without pipelining the 128 experts of a layer are FSDP-sharded over 256 ranks,
    half of them padding: the states alone (rehearsed) exceed 25 GiB. The search goes on to pipeline
    stages and names pp = 2, whose estimate, applied, fits."""
    cfg = load_config(str(PRETRAIN), [f"--model.hf_path={pretrain_folder}", "--parallelism.pp=1"])
    assert rehearse(cfg, 256, [0])[0].states > 25 * GiB
    found = fitting_layout(cfg, 256, 25.0, on_gloo=False)
    assert found is not None and found.startswith("pp = 2 ("), found
    named = dict(re.findall(r"(\w+) = '?(\w+)'?", found.split(" (estimated")[0]))
    trial = load_config(str(PRETRAIN), [f"--model.hf_path={pretrain_folder}"]
                        + [f"--parallelism.{k}={v}" for k, v in named.items() if k != "dp_shard"])
    e = estimate(trial, 256, on_gloo=False, device_memory=25 * GiB)
    assert e.dims.dp_shard == int(named["dp_shard"]) and e.total <= 25 * GiB


def test_the_tiny_twin_is_the_pretrain_config_on_two_ranks():
    """Same sections and keys (the architecture from a flavor instead of a config.json folder);
    pp = 2 with the same schedule, the balancing loss over the global batch, trained."""
    full, tiny = (tomllib.loads(p.read_text()) for p in (PRETRAIN, PRETRAIN_TINY))
    tiny["model"]["hf_path"] = tiny["model"].pop("flavor")
    assert {s: sorted(t) for s, t in full.items()} == {s: sorted(t) for s, t in tiny.items()}
    tiny["model"]["flavor"] = tiny["model"].pop("hf_path")
    assert tiny["parallelism"]["pp"] == 2 and tiny["parallelism"]["pp_schedule"] == full["parallelism"]["pp_schedule"]
    assert tiny["model"]["aux_loss_scope"] == "global_batch"
    assert get_flavor(tiny["model"]["flavor"]).output_router_logits
    cfg = load_config(str(PRETRAIN_TINY), [])
    assert estimate(cfg, 2).pipeline.layout.describe().startswith("pp=2")


@pytest.mark.slow
def test_tiny_twin_trains_with_pp2_as_one_process(tmp_path):
    """configs/qwen3-235b-a22b-pretrain-tiny.toml on 2 ranks (2 pipeline stages, the MoE balancing
    loss over the global batch) and on one process (pp = 1): the same losses, gradient norms and
    balancing losses at every step."""
    from titanite.run.trainer import Trainer

    config = str(PRETRAIN_TINY)
    common = ["--metrics.progress_bar=off", "--checkpoint.export_hf=false"]
    one = Trainer(load_config(config, [*common, f"--job.output_dir={tmp_path / 'one'}", "--parallelism.pp=1"]))
    one.train()
    one.close()
    proc = torchrun(2, ["--config", config, *common, f"--job.output_dir={tmp_path / 'pp2'}"])
    assert "pipeline: pp=2" in proc.stderr
    steps = [r["step"] for r in read_metrics(tmp_path / "one")]
    assert_same_run(tmp_path / "one", tmp_path / "pp2", steps)
    assert all("aux_loss" in r for r in read_metrics(tmp_path / "pp2"))


def test_the_estimate_refuses_what_the_pipeline_refuses():
    """Tied embeddings (the first and the last stage would share one matrix), as training does."""
    from titanite.core.errors import UserError

    with pytest.raises(UserError, match="tied input and output embeddings"):
        estimate(_cfg({"parallelism.pp": 2}, "debug-moe"), 2)

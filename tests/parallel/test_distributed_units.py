"""In-process checks of the parallel layer: layout validation, activation checkpointing and
compile against the plain model, and the memory/FLOPs estimator against measurements."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY_MOE
from titanite import kernels
from titanite.commands.estimate import main as estimate_main
from titanite.core.config import ParallelismConfig, load_config
from titanite.core.errors import UserError
from titanite.models.qwen3.args import Qwen3Args, to_hf_config
from titanite.models.qwen3.model import Qwen3
from titanite.parallel.checkpointing import apply_activation_checkpointing, apply_compile
from titanite.parallel.mesh import ParallelDims
from titanite.plan import estimate

DENSE = Qwen3Args(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16)
MOE = DENSE.replace(**TINY_MOE)


# -- layout validation ------------------------------------------------------------------------

@pytest.mark.parametrize("world, overrides, message", [
    (4, {"tp": 3}, r"parallelism.dp_replicate \(1\) x parallelism.tp \(3\) = 3 does not divide the world size 4"),
    (4, {"dp_shard": 3}, r"dp_replicate \(1\) x dp_shard \(3\) x tp \(1\) = 3, but the world size is 4"),
    (8, {"dp_replicate": 2, "dp_shard": 2}, r"= 4, but the world size is 8"),
    (4, {"ep": 3}, r"parallelism.ep \(3\) must divide parallelism.dp_shard \(4\)"),
    (4, {"compile": True, "tp": 2}, r"parallelism.compile = true together with parallelism.tp \(2\) is not supported"),
])
def test_layout_that_does_not_fit_the_world_is_refused(world, overrides, message):
    with pytest.raises(UserError, match=message):
        ParallelDims.resolve(ParallelismConfig(**overrides), world)


def test_layout_degrees_resolve():
    d = ParallelDims.resolve(ParallelismConfig(dp_replicate=2, tp=2), 16)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.ep, d.dp) == (2, 4, 2, 1, 8)
    d = ParallelDims.resolve(ParallelismConfig(dp_replicate=2, ep=4), 16)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.ep, d.dp) == (2, 8, 1, 4, 16)
    d = ParallelDims.resolve(ParallelismConfig(ep=2, tp=2), 4)  # EP x TP: experts on dp_shard ranks
    assert (d.dp_replicate, d.dp_shard, d.tp, d.ep, d.dp) == (1, 2, 2, 2, 2)


@pytest.mark.parametrize("args, overrides, message", [
    (DENSE, {"tp": 4}, r"parallelism.tp \(4\) must divide num_key_value_heads \(2\)"),
    (DENSE.replace(num_heads=6, num_kv_heads=6), {"tp": 4}, r"parallelism.tp \(4\) must divide num_attention_heads \(6\)"),
    (DENSE.replace(vocab_size=513), {"tp": 2}, r"parallelism.tp \(2\) must divide vocab_size \(513\)"),
    (MOE, {"ep": 8}, r"parallelism.ep \(8\) must divide num_experts \(4\)"),
    (DENSE, {"ep": 2}, r"parallelism.ep = 2 but the model \(config.json\) is dense"),
    (MOE, {"tp": 4, "ep": 2}, r"parallelism.tp \(4\) must divide num_key_value_heads \(2\)"),
])
def test_degrees_that_do_not_divide_the_model_are_refused(args, overrides, message):
    d = ParallelDims.resolve(ParallelismConfig(**overrides), 8)
    with pytest.raises(UserError, match=message):
        d.check_model(to_hf_config(args))


def test_trainer_refuses_a_bad_layout_before_any_work(tmp_path, monkeypatch, tiny_hf, tiny_data):
    from titanite.run.trainer import Trainer

    # What torchrun --nproc_per_node=2 sets; the check comes before any process group.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "run"
    cfg = load_config(None, [f"--job.output_dir={out}", f"--model.hf_path={tiny_hf}", f"--data.path={tiny_data}",
                             "--parallelism.tp=4"])
    with pytest.raises(UserError, match="does not divide the world size 2"):
        Trainer(cfg)
    assert not out.exists()


# -- activation checkpointing and compile: same numbers as the plain model ------------------

def _loss_and_grads(model: Qwen3, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _model(args: Qwen3Args) -> Qwen3:
    torch.manual_seed(0)
    model = Qwen3(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_math(args, mode):
    ids = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    plain_loss, plain_grads = _loss_and_grads(_model(args), ids)
    model = _model(args)
    apply_activation_checkpointing(model.layers, mode)
    loss, grads = _loss_and_grads(model, ids)
    assert loss.item() == pytest.approx(plain_loss.item(), abs=1e-6)
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert set(model.state_dict()) == set(_model(args).state_dict())  # names unchanged


@pytest.mark.slow
def test_compiled_blocks_keep_the_math():
    ids = torch.randint(0, DENSE.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    plain_loss, plain_grads = _loss_and_grads(_model(DENSE), ids)
    model = _model(DENSE)
    apply_activation_checkpointing(model.layers, "selective")
    apply_compile(model.layers, torch.device("cpu"))
    loss, grads = _loss_and_grads(model, ids)
    assert loss.item() == pytest.approx(plain_loss.item(), abs=1e-5)
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)


# -- the estimator against measured memory and counted FLOPs --------------------------------

def _measured(args: Qwen3Args, mode: str, batch: int, seq: int) -> dict[str, int]:
    """Bytes by category from torch's MemTracker over one training step: parameters and
    optimizer state at their peak, activations alive at the end of the forward."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    model = _model(args)
    apply_activation_checkpointing(model.layers, mode)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    ids = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids).backward()  # a first step creates the optimizer state
    optimizer.step()
    optimizer.zero_grad()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        model(ids, labels=ids).backward()
        grads = sum(p.grad.nbytes for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    peak = tracker.get_tracker_snapshot("peak")
    after_forward = tracker.memory_tracking[model].snapshots[_ModState.POST_FW][-1]
    (device,) = peak
    return {"params": peak[device][_MemRefType.PARAM], "grads": grads,
            "optimizer": peak[device][_MemRefType.OPT],
            "activations": after_forward[device][_MemRefType.ACT]}


@pytest.mark.parametrize("args, mode", [(DENSE, "none"), (DENSE, "full"), (DENSE, "selective"),
                                        (MOE, "none"), (MOE, "selective")],
                         ids=["dense-none", "dense-full", "dense-selective", "moe-none", "moe-selective"])
def test_estimate_matches_measured_memory(args, mode):
    batch, seq = 2, 64
    measured = _measured(args, mode, batch, seq)
    # The measured model runs its call sites' defaults, the chunked loss among them.
    cfg = load_config(None, [f"--parallelism.activation_checkpoint={mode}", f"--training.batch_size={batch}",
                             f"--data.seq_len={seq}", "--kernels.loss=chunked"])
    e = estimate(cfg, 1, args)
    assert e.params == measured["params"]
    assert e.grads == measured["grads"]
    # AdamW's two moments, plus a 4-byte step counter per tensor that the estimate leaves out.
    assert 0 <= measured["optimizer"] - e.optimizer <= 4 * len(list(_model(args).parameters()))
    assert e.activations == pytest.approx(measured["activations"], rel=0.02)
    if mode != "none":
        assert e.recompute > 0 and e.activations < estimate(load_config(None, [
            f"--training.batch_size={batch}", f"--data.seq_len={seq}", "--kernels.loss=chunked"]), 1, args).activations


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
def test_estimated_flops_match_counted_flops(args):
    """FLOPs counted by torch's FlopCounterMode over a forward and backward. Attention and
    experts run their reference kernels (plain matmuls the counter sees)."""
    from torch.utils.flop_counter import FlopCounterMode

    batch, seq = 2, 64
    model = _model(args)
    kernels.attach(model, {"attention": "reference", "moe.experts": "reference"}, "cpu", torch.float32)
    ids = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3))
    with FlopCounterMode(display=False) as counter:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    cfg = load_config(None, [f"--training.batch_size={batch}", f"--data.seq_len={seq}"])
    assert estimate(cfg, 1, args).flops_per_step == pytest.approx(counter.get_total_flops(), rel=0.01)


def test_estimate_command_reports_per_rank_memory(tiny_hf, capsys):
    assert estimate_main([f"--model.hf_path={tiny_hf}", "--world-size=4", "--parallelism.tp=2",
                          "--parallelism.activation_checkpoint=full"]) == 0
    out = capsys.readouterr().out
    assert "4 ranks (dp_replicate=1, dp_shard=2, tp=2, ep=1)" in out
    for row in ("parameters", "gradients", "optimizer", "activations", "transient", "peak"):
        assert row in out
    # Sharding over more ranks needs less memory per rank.
    cfg = load_config(None, [f"--model.hf_path={tiny_hf}"])
    assert estimate(cfg, 4).params < estimate(cfg, 2).params < estimate(cfg, 1).params


def test_estimate_command_names_a_layout_error(tiny_hf, capsys):
    from titanite.cli import main

    assert main(["estimate", f"--model.hf_path={tiny_hf}", "--world-size=4", "--parallelism.tp=3"]) == 2
    assert "does not divide the world size 4" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["hf", "qwen3"])
def test_estimate_and_training_accept_the_same_expert_parallel_layouts(tmp_path, tiny_hf, spec):
    """ep on a transformers-written MoE checkpoint (its config.json says num_local_experts) is
    accepted by both backends' estimate and training preflight; ep on a dense one and ep that
    does not divide the experts are refused by both with the same message."""
    from tests.conftest import make_hf_checkpoint
    from titanite.models.spec import get_spec
    from titanite.run.preflight import check_layout

    moe = make_hf_checkpoint(tmp_path / "moe", **TINY_MOE)
    cases = {(moe, 2): None, (tiny_hf, 2): "is dense", (moe, 8): r"parallelism.ep \(8\) must divide num_experts \(4\)"}
    for (folder, ep), error in cases.items():
        cfg = load_config(None, [f"--model.hf_path={folder}", f"--model.spec={spec}", f"--parallelism.ep={ep}"])
        dims = ParallelDims.resolve(cfg.parallelism, 8)
        handle = get_spec(spec).build(cfg.model)
        if error is None:
            check_layout(dims, handle)  # what training runs before any work
            assert estimate(cfg, 8).params > 0
            continue
        with pytest.raises(UserError, match=error):
            check_layout(dims, handle)
        with pytest.raises(UserError, match=error):
            estimate(cfg, 8)

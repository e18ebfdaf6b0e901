"""`titanite estimate` on DPO runs (training.objective = "dpo"): what each reference costs and
what the pairs cost, against figures computed here from the model's own config (parameter counts
from the transformers model, logits from the vocabulary), not from the planner's numbers, and
against the bytes a real DPO step allocates.

- a live reference model (no LoRA) adds its parameters, fp32 and sharded as the policy, to every
  moment of the step, and a moment of its own, its no-grad forward, before the policy's;
- a precomputed reference adds nothing;
- a LoRA run's reference is its base with the adapters switched off: no second copy;
- a pair is two sequences, and their log-probabilities come from the loss op one sequence at a
  time (the reference op keeps every sequence's fp32 log-softmax; under tensor parallel the
  logits are gathered whole);
- the rehearsal builds the reference model under the fake process group when it is a model.
"""

from __future__ import annotations

import json
import tomllib

import pytest

from tests.conftest import REPO
from titanite.commands.estimate import main as estimate_main
from titanite.core.config import load_config
from titanite.models.qwen3.args import to_hf_config
from titanite.models.qwen3.flavors import get_flavor
from titanite.plan import estimate
from titanite.plan.counts import GiB
from titanite.plan.rehearse import rehearse

SMALL = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
B, S = 2, 16  # pairs per micro-batch, tokens per sequence
DPO = ("--training.objective=dpo", "--data.format=preference")


def _parameters(tied: bool) -> int:
    """The model's parameter count, from transformers (tied weights once)."""
    import transformers

    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, tie_word_embeddings=tied))
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """config.json only (the estimate reads no weights), tied and untied."""
    import transformers

    out = {}
    for name, tied in (("tied", True), ("untied", False)):
        folder = tmp_path_factory.mktemp(name)
        transformers.Qwen3Config(**SMALL, tie_word_embeddings=tied).save_pretrained(folder)
        out[name] = str(folder)
    return out


def _cfg(folder: str, *extra: str, batch: int = B, dpo: bool = True):
    return load_config(None, [f"--model.hf_path={folder}", f"--training.batch_size={batch}", f"--data.seq_len={S}",
                              *(DPO if dpo else ()), *extra])


def _estimate(folder: str, *extra: str, world: int = 1, **kw):
    return estimate(_cfg(folder, *extra, **kw), world, on_gloo=False)


def _common_phase_differences(a, b) -> set[float]:
    return {round(a.phases[k] - b.phases[k]) for k in b.phases}


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_a_live_reference_adds_its_fp32_parameters_to_every_moment(folders, kind):
    n = _parameters(kind == "tied")
    live, pre = (_estimate(folders[kind], f"--preference.reference={r}") for r in ("model", "precomputed"))
    assert live.preference.kind == "model" and live.preference.params_bytes == 4 * n  # fp32, one rank
    assert _common_phase_differences(live, pre) == {4 * n}
    assert live.states == pre.states  # no gradients, no optimizer state for the reference
    assert set(live.phases) == set(pre.phases) | {"reference forward"}
    assert live.total >= pre.total + 4 * n


@pytest.mark.parametrize("kind", ["tied", "untied"])
@pytest.mark.parametrize("mp", ["none", "bf16"])
def test_under_fsdp_the_reference_is_sharded_and_reshards_its_root(folders, kind, mp):
    """Two ranks: half the parameters each (FSDP pads dim 0); the root group, which FSDP2 leaves
    gathered after a forward, is resharded after the reference's (titanite/run/preference/reference.py),
    so nothing of it is held all step."""
    n, (V, H) = _parameters(kind == "tied"), (SMALL["vocab_size"], SMALL["hidden_size"])
    live, pre = (_estimate(folders[kind], f"--preference.reference={r}", f"--training.mixed_precision={mp}",
                           world=2) for r in ("model", "precomputed"))
    p = live.preference
    assert 4 * n / 2 <= p.params_bytes <= 1.02 * 4 * n / 2
    assert p.params_bytes == live.params  # sharded and stored as the policy
    assert _common_phase_differences(live, pre) == {round(p.params_bytes)}


@pytest.mark.parametrize("loss", ["chunked", "reference"])
def test_a_precomputed_reference_adds_nothing(folders, loss):
    live, pre = (_estimate(folders["tied"], f"--kernels.loss={loss}", f"--preference.reference={r}")
                 for r in ("model", "precomputed"))
    assert pre.preference.kind == "precomputed" and pre.preference.reference_bytes == 0
    assert "reference forward" not in pre.phases and pre.flops_per_step < live.flops_per_step
    assert _common_phase_differences(live, pre) == {live.reference}


@pytest.mark.parametrize("ac", ["none", "full"])
def test_a_pair_is_two_sequences(folders, ac):
    """In fp32 with the chunked loss (one fp32 log-sum-exp per token, as the language model's),
    a micro-batch of B pairs keeps what one of 2B sequences does, twice what B sequences do."""
    dpo = _estimate(folders["tied"], "--preference.reference=precomputed", "--kernels.loss=chunked",
                    f"--parallelism.activation_checkpoint={ac}")
    lm = {n: _estimate(folders["tied"], "--kernels.loss=chunked", f"--parallelism.activation_checkpoint={ac}",
                       batch=n, dpo=False) for n in (B, 2 * B)}
    assert (dpo.activations, dpo.recompute) == (lm[2 * B].activations, lm[2 * B].recompute)
    assert dpo.activations == 2 * lm[B].activations and dpo.recompute == 2 * lm[B].recompute
    assert dpo.tokens_per_step == lm[2 * B].tokens_per_step == 2 * B * S
    assert dpo.flops_per_step == lm[2 * B].flops_per_step


@pytest.mark.parametrize("mp", ["none", "bf16"])
def test_the_reference_loss_op_keeps_every_sequence_s_fp32_log_softmax(folders, mp):
    """One sequence at a time through the loss op: all 2B sequences' fp32 log-softmax [S, V] are
    kept for backward, but the backward's gradients are one sequence's."""
    V = SMALL["vocab_size"]
    ref, chunked = (_estimate(folders["tied"], "--preference.reference=precomputed", f"--kernels.loss={loss}",
                              f"--training.mixed_precision={mp}") for loss in ("reference", "chunked"))
    assert ref.activations - chunked.activations == 2 * B * S * (V - 1) * 4  # log-softmax, not log-sum-exp
    row = S * V * 4  # one sequence's fp32 [S, V]
    during = ref.params + ref.optimizer + ref.activations + ref.transient
    assert during + 2 * row <= ref.phases["loss backward"] < during + 2 * 2 * B * row


def test_under_tensor_parallel_the_logits_are_gathered_whole(folders):
    """tp = 2: the vocabulary-sharded logits are gathered, so each rank keeps the whole
    vocabulary's fp32 log-softmax of the micro-batch, and its backward their whole gradients."""
    V = SMALL["vocab_size"]
    dpo = _estimate(folders["tied"], "--parallelism.tp=2", "--preference.reference=precomputed",
                    "--training.mixed_precision=bf16", world=2)
    logits = 2 * B * S * V * 4  # fp32 [2B x S, V], the whole vocabulary
    assert dpo.activations >= logits and "gathered" in dpo.preference.loss
    assert dpo.phases["loss backward"] >= dpo.params + dpo.optimizer + dpo.activations + 2 * logits


def test_kernels_loss_auto_is_resolved_on_the_device_planned_for(folders):
    """Above a tenth of the device, one micro-batch's fp32 logits take the chunked loss, as
    training resolves it there; a DPO micro-batch of B pairs has 2B sequences of logits."""
    V = SMALL["vocab_size"]
    memory = 10 * 1.5 * B * S * V * 4  # a tenth of it: between B and 2B sequences' fp32 logits

    def planned(*extra: str, dpo: bool = True, **kw):
        return estimate(_cfg(folders["tied"], *extra, dpo=dpo), 1, on_gloo=False, **kw).phases

    assert planned(device_memory=memory) == planned("--kernels.loss=chunked") != planned("--kernels.loss=reference")
    assert planned(dpo=False, device_memory=memory) == planned("--kernels.loss=reference", dpo=False)


@pytest.mark.parametrize("mp", ["none", "bf16"])
def test_the_reference_forward_holds_one_sequence_s_logits_not_its_activations(folders, mp):
    V, H, c = SMALL["vocab_size"], SMALL["hidden_size"], 2 if mp == "bf16" else 4
    live = _estimate(folders["tied"], f"--training.mixed_precision={mp}", "--kernels.loss=reference")
    kept_without_checkpointing = _estimate(folders["tied"], "--preference.reference=precomputed",
                                           f"--training.mixed_precision={mp}").activations
    # one sequence's logits in the compute dtype, their fp32 copy (16-bit only) and log-softmax; the
    # final hidden states of the micro-batch
    head = S * V * (c + 4 + (4 if c == 2 else 0)) + 2 * B * S * H * (c + (4 if c == 2 else 0))
    f = live.preference.forward_bytes
    assert head <= f < head + kept_without_checkpointing / SMALL["num_hidden_layers"]
    # it runs before the policy's forward: beside it only the states (no gradients yet)
    assert live.phases["reference forward"] == live.params + live.optimizer + live.preference.params_bytes + f


@pytest.mark.parametrize("mp", ["none", "bf16"])
def test_the_reference_forward_is_what_a_no_grad_forward_allocates(tmp_path, mp):
    """The reference's log-probabilities (titanite/run/preference/reference.py, sequence_logps) on a
    frozen native model with a large vocabulary and the reference loss op, its allocations read
    from the profiler, against the planned bytes: at most 1% below (per-token values it leaves
    out) and 10% above."""
    import torch
    import transformers

    from tests.fixtures.startup_probe import _peak_live_bytes, _profiled
    from titanite.models.spec import get_spec
    from titanite.run.preference.reference import sequence_logps

    V = 8192
    transformers.Qwen3Config(**{**SMALL, "vocab_size": V, "hidden_size": 64}).save_pretrained(tmp_path)
    cfg = _cfg(str(tmp_path), f"--training.mixed_precision={mp}", "--kernels.loss=reference")
    planned = estimate(cfg, 1).preference.forward_bytes
    handle = get_spec("qwen3").build(cfg.model)
    handle.attach_kernels(cfg.kernels, "cpu", torch.float32)
    handle.module.to_empty(device="cpu")
    handle.init_buffers()
    handle.init_weights(0.02, 0)
    handle.module.requires_grad_(False)
    ids = torch.randint(0, V, (2 * B, S), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "position_ids": torch.arange(S).expand(2 * B, S), "labels": ids.roll(-1, 1)}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mp == "bf16")
    with torch.no_grad(), _profiled() as prof:
        _, logps, _ = sequence_logps(handle, batch, autocast)
    measured = _peak_live_bytes(prof, set())
    assert logps.shape == (2 * B,) and 0.99 * measured <= planned <= 1.1 * measured, (measured, planned)


# A real DPO step's peak (one process, CPU): two steps of a tiny tied Qwen3 with a large
# vocabulary on 2 pairs x 96 tokens, the second under the profiler, plus the states (and the
# reference model's parameters) alive as it began, as tests/plan/test_estimate_peak.py measures the
# language model's. name: (overrides, slow)
STEP_CASES = {
    "live": ({}, False),
    "live_chunked_bf16": ({"kernels.loss": "chunked", "training.mixed_precision": "bf16"}, False),
    "precomputed": ({"preference.reference": "precomputed"}, True),
    "live_accumulating": ({"training.global_batch_size": 4}, True),
    "live_checkpointing": ({"parallelism.activation_checkpoint": "full"}, True),
    "live_bf16": ({"training.mixed_precision": "bf16"}, True),
    "lora": ({"lora.enabled": True, "lora.rank": 4, "model.init": "auto"}, True),
    "lora_chunked_bf16": ({"lora.enabled": True, "lora.rank": 4, "model.init": "auto", "kernels.loss": "chunked",
                           "training.mixed_precision": "bf16"}, True),
}
STEP_PROBE = """
import json, sys
from tests.fixtures.startup_probe import _peak_live_bytes, _profiled, live_state_bytes
from titanite.core.config import load_config
from titanite.parallel.distributed import exit_process
from titanite.run.trainer import Trainer
t = Trainer(load_config(None, sys.argv[1:]))
t.train_step().read()
t.step += 1
ref = t.preference.reference
held = {}
if ref is not None and ref.kind == "model":
    held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in ref.handle.module.parameters()}
before = live_state_bytes(t) + sum(held.values())
with _profiled() as prof:
    t.train_step().read()
print("PEAK", json.dumps({"peak": before + _peak_live_bytes(prof, set())}))
t.close()
t.world.close()
exit_process(0)
"""


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, object]:
    from tests.conftest import make_hf_checkpoint
    from tests.fixtures.chat import make_chat_tokenizer
    from tests.fixtures.preference import write_pair_data

    root = tmp_path_factory.mktemp("pairs")
    hf = make_hf_checkpoint(root / "hf", make_chat_tokenizer(root / "tok"), vocab_size=8192, hidden_size=64,
                            tie_word_embeddings=True)
    return {"hf": hf, "data": write_pair_data(root / "data")["conversational"]}


@pytest.mark.parametrize("case", [pytest.param(n, marks=[pytest.mark.slow] if slow else [])
                                  for n, (_, slow) in STEP_CASES.items()])
def test_the_estimate_bounds_a_dpo_step_s_peak(pairs, case, tmp_path):
    """Within 3% above and 5% below: 16-bit runs on CPU hold a few fp32 [tokens, H] temporaries
    the block counts leave out (up to 5% below here); fp32 runs agree within 1%."""
    import subprocess
    import sys

    from tests.parallel.test_distributed import _env

    opts = {"model.hf_path": pairs["hf"], "data.path": pairs["data"], "data.format": "preference",
            "training.objective": "dpo", "data.seq_len": 96, "training.batch_size": 2, "training.steps": 4,
            "model.init": "random", "checkpoint.interval": 0, "checkpoint.export_hf": False,
            "metrics.progress_bar": "off", "metrics.peak_tflops": 1.0, "job.output_dir": tmp_path / "run",
            **STEP_CASES[case][0]}
    args = [f"--{k}={v}" for k, v in opts.items()]
    proc = subprocess.run([sys.executable, "-c", STEP_PROBE, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PEAK ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    measured = json.loads(lines[0].removeprefix("PEAK "))["peak"]
    e = estimate(load_config(None, args), 1, on_gloo=True, gloo_buffers=False)
    assert 0.95 * measured <= e.total <= 1.03 * measured, (measured, e.phases)


@pytest.mark.parametrize("reference", ["model", "precomputed"])
def test_accumulated_gradients_are_held_through_the_next_micro_batch(folders, reference):
    """Two micro-batches per step: the second runs (reference forward, policy forward and
    backward) beside the first's fp32 gradients."""
    one, two = (_estimate(folders["tied"], f"--preference.reference={reference}",
                          f"--training.global_batch_size={k * B}") for k in (1, 2))
    n = _parameters(True)
    assert one.grads == two.grads == 4 * n
    for moment in ("loss backward", "blocks' backward") + (("reference forward",) if reference == "model" else ()):
        assert two.phases[moment] == one.phases[moment] + 4 * n, moment
    for moment in ("backward end", "optimizer step"):  # the gradients are there already
        assert two.phases[moment] == one.phases[moment], moment
    lm_one, lm_two = (_estimate(folders["tied"], f"--training.global_batch_size={k * B}", dpo=False) for k in (1, 2))
    assert lm_two.phases["loss backward"] == lm_one.phases["loss backward"] + 4 * n  # the same for 'lm'


def test_under_fsdp_every_reference_forward_gathers_the_root(folders):
    """Adapters off (the policy's module) or a separate, resharded copy: the reference's forward
    gathers the root group (tied: the embedding and the final norm) in the compute dtype."""
    bf16 = ("--training.mixed_precision=bf16", "--lora.base_dtype=bf16")
    off = _estimate(folders["tied"], "--lora.enabled=true", *bf16, world=2).preference
    copy = _estimate(folders["tied"], *bf16, world=2).preference
    assert off.forward_bytes == copy.forward_bytes > 0


def test_lora_s_reference_is_the_base_with_the_adapters_off(folders):
    n = _parameters(True)
    lora = ("--lora.enabled=true", "--lora.rank=4", "--lora.base_dtype=bf16", "--training.mixed_precision=bf16")
    live, pre = (_estimate(folders["tied"], *lora, f"--preference.reference={r}") for r in ("model", "precomputed"))
    lm = _estimate(folders["tied"], *lora, batch=2 * B, dpo=False)
    assert live.preference.kind == "adapters off" and live.preference.reference_bytes == 0
    assert live.params == pre.params == lm.params == n * 2 + live.lora.adapter_bytes  # the bf16 base, once
    assert _common_phase_differences(live, pre) == {0}
    # only the forward: the same as a second copy's, whose parameters it does without
    copy = _estimate(folders["tied"], "--training.mixed_precision=bf16")
    assert live.preference.forward_bytes == copy.preference.forward_bytes > 0
    assert set(live.phases) - set(pre.phases) == {"reference forward"}
    assert live.total - pre.total <= live.preference.forward_bytes
    # a reference_path is another model: held as a second copy, as without LoRA
    other = _estimate(folders["tied"], *lora, f"--preference.reference_path={folders['tied']}")
    assert other.preference.kind == "model" and other.preference.params_bytes == 4 * n


@pytest.mark.parametrize("extra", [("--preference.loss_type=simpo",),
                                   ("--preference.loss_type=simpo", "--preference.reference=none")])
def test_a_reference_free_loss_holds_no_reference(folders, extra):
    free = _estimate(folders["tied"], *extra)
    pre = _estimate(folders["tied"], "--preference.reference=precomputed")
    assert free.preference.kind == "none" and free.phases == pre.phases


@pytest.mark.parametrize("ac, ratio", [("none", 4 / 3), ("full", 5 / 4)])
def test_the_reference_forward_adds_a_third_of_a_training_step_s_flops(folders, ac, ratio):
    """Training is 3 forwards' worth (4 with full checkpointing); the reference runs one more."""
    live, pre = (_estimate(folders["tied"], f"--preference.reference={r}",
                           f"--parallelism.activation_checkpoint={ac}") for r in ("model", "precomputed"))
    assert live.flops_per_step == pytest.approx(pre.flops_per_step * ratio, rel=1e-9)


def test_the_report_names_the_reference_and_its_bytes(folders, capsys):
    args = ["--world-size", "1", "--plan-for", "accelerator", f"--model.hf_path={folders['tied']}", *DPO,
            f"--training.batch_size={B}", f"--data.seq_len={S}"]
    n = _parameters(True)
    assert estimate_main(args) == 0
    out = capsys.readouterr().out
    assert f"{B} pairs per micro-batch = {2 * B} sequences x {S}" in out
    assert "reference (model): a second frozen copy of the model, fp32" in out
    assert f"{4 * n / GiB:.3f} GiB per rank" in out
    assert "reference model (frozen, fp32, sharded)" in out and "at reference forward" in out
    assert estimate_main(args + ["--rehearse", "--device-memory-gib=1"]) == 0  # the rehearsal builds it too
    out = capsys.readouterr().out
    assert "optimizer 1.000, reference model 1.000" in out and "fits 1 GiB" in out
    assert estimate_main(args + ["--preference.reference=precomputed"]) == 0
    out = capsys.readouterr().out
    assert "reference (precomputed): precomputed log-probabilities" in out and "at reference forward" not in out
    assert estimate_main(args + ["--lora.enabled=true"]) == 0
    out = capsys.readouterr().out
    assert "the base with the adapters switched off (LoRA): no second copy" in out
    assert "reference model (frozen" not in out and "at reference forward" in out


@pytest.mark.parametrize("world, extra", [(2, ()), (2, ("--parallelism.tp=2",)), (4, ("--parallelism.tp=2",))])
def test_the_rehearsal_builds_the_reference_model_as_the_policy(world, extra):
    """The debug flavor under the fake process group: the reference's shards are the policy's."""
    opts = ["--model.flavor=debug", "--training.batch_size=1", "--data.seq_len=32", *DPO, *extra]
    cfg = load_config(None, opts)
    e = estimate(cfg, world)
    for f in rehearse(cfg, world):
        assert f.reference == f.params  # fp32, the same plan
        assert abs(f.reference - e.preference.params_bytes) <= 0.05 * f.reference
        assert f.startup_peak > f.params + f.reference
    for other in ("--preference.reference=precomputed", "--preference.loss_type=simpo"):
        assert [f.reference for f in rehearse(load_config(None, opts + [other]), world)] == [0, 0]


def test_the_rehearsal_holds_no_second_model_for_lora(folders):
    cfg = _cfg(folders["tied"], "--lora.enabled=true", "--lora.rank=4")
    (f,) = rehearse(cfg, 1)
    assert f.reference == 0 and f.grads * 4 < f.params


def test_the_dpo_config_and_its_tiny_twin(tmp_path):
    """Same sections and keys; valid as written; the 4B config fits one 80 GB GPU by the estimate
    (its config.json from the 4B-2507 flavor: the estimate reads no weights)."""
    full, tiny = (tomllib.loads((REPO / "configs" / f"qwen3-4b-instruct-2507-{n}.toml").read_text())
                  for n in ("dpo", "dpo-tiny"))
    assert {s: sorted(t) for s, t in full.items()} == {s: sorted(t) for s, t in tiny.items()}
    assert full["training"]["objective"] == "dpo" and full["lora"]["enabled"] and full["data"]["format"] == "preference"
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(get_flavor("4B-2507"))))
    cfg = load_config(str(REPO / "configs" / "qwen3-4b-instruct-2507-dpo.toml"), [f"--model.hf_path={tmp_path}"])
    e = estimate(cfg, 1, on_gloo=False)
    assert e.preference.kind == "adapters off" and e.total < 80 * GiB
    tiny_cfg = load_config(str(REPO / "configs" / "qwen3-4b-instruct-2507-dpo-tiny.toml"),
                           [f"--model.hf_path={tmp_path}"])
    assert estimate(tiny_cfg, 1).preference.kind == "adapters off"

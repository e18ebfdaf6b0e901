"""`titanite estimate` on LoRA runs: the adapter count against peft's, and the byte accounting
(frozen base without gradients or optimizer state, fp32 adapters with both)."""

from __future__ import annotations

import pytest
import torch

from titanite.commands.estimate import main as estimate_main
from titanite.core.config import load_config
from titanite.core.errors import UserError
from titanite.plan import estimate
from titanite.plan.lora import ATTENTION, EXPERTS

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
# 4 experts; layer 1 is dense, so the MoE model has both kinds of MLP (titanite leaves the
# dense one to its base weights: see _peft_trainable).
SMALL_MOE = dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1])
# "-wide": attention 64 wide on a 32-wide residual stream, so that q_proj and o_proj have
# different in and out features (a column-parallel and a row-parallel split then differ).
WIDE = dict(head_dim=16)


def _transformers_model(kind: str):
    import transformers

    torch.manual_seed(0)
    wide = WIDE if kind.endswith("-wide") else {}
    if kind.startswith("moe"):
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**SMALL_MOE, **wide}))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**SMALL, **wide}))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    out = {}
    for kind in ("dense", "moe", "dense-wide", "moe-wide"):
        folder = tmp_path_factory.mktemp(kind)
        _transformers_model(kind).save_pretrained(folder)
        out[kind] = str(folder)
    return out


def _peft_model(kind: str, targets: list[str], r: int):
    """The tiny model wrapped by peft for titanite's target names: dense linears by module
    name ('all-linear': peft's own choice, which leaves out the head), the experts' fused
    projections by parameter (target_parameters). In an MoE model titanite adapts the attention
    and the experts only, and these are named exactly: peft reads gate_proj / up_proj /
    down_proj there as the experts' pre-transformers-5 names (and would rewrite them)."""
    import peft

    if targets == ["all-linear"]:
        targets = list(ATTENTION + EXPERTS) if kind.startswith("moe") else ["all-linear"]
    modules = [t for t in targets if t not in EXPERTS]
    params = [f"mlp.{t}" for t in targets if t in EXPERTS]
    return peft.get_peft_model(_transformers_model(kind), peft.LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=modules if modules != ["all-linear"] else "all-linear",
        target_parameters=params or None))


def _peft_trainable(kind: str, targets: list[str], r: int) -> int:
    """peft's trainable-parameter count for titanite's target names (see _peft_model)."""
    return sum(p.numel() for p in _peft_model(kind, targets, r).parameters() if p.requires_grad)


def _cfg(folder: str, *extra: str):
    return load_config(None, [f"--model.hf_path={folder}", "--lora.enabled=true", "--training.batch_size=2",
                              "--data.seq_len=16", *extra])


@pytest.mark.parametrize("kind, names", [
    ("dense", ["all-linear"]), ("dense", ["q_proj", "v_proj"]), ("dense", ["down_proj", "o_proj"]),
    ("moe", ["all-linear"]), ("moe", ["q_proj", "v_proj"]), ("moe", ["experts.gate_up_proj"]),
    ("moe", ["k_proj", "experts.down_proj", "o_proj"]),
])
@pytest.mark.parametrize("r", [4, 8])
def test_adapter_count_is_peft_s(folders, kind, names, r):
    expected = _peft_trainable(kind, names, r)
    e = estimate(_cfg(folders[kind], f"--lora.rank={r}", f"--lora.target_modules={','.join(names)}"), 1)
    print(f"{kind} r={r} {names}: estimate {e.lora.adapters} adapters, peft {expected}")
    assert e.lora.adapters == expected
    assert e.lora.base == sum(p.numel() for p in _transformers_model(kind).parameters())


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("base_dtype", ["fp32", "bf16"])
def test_bytes_frozen_base_and_fp32_adapters(folders, kind, base_dtype):
    cfg = _cfg(folders[kind], f"--lora.base_dtype={base_dtype}", "--training.mixed_precision=bf16", "--lora.rank=4")
    one, two = estimate(cfg, 1), estimate(cfg, 2)
    n, base_bytes = one.lora, 2 if base_dtype == "bf16" else 4
    # Single process: everything whole. Only the adapters have gradients and AdamW moments.
    assert one.grads == n.adapters * 4 and one.optimizer == n.adapters * 8
    assert one.params == n.base * base_bytes + n.adapters * 4
    assert (n.base_bytes, n.adapter_bytes) == (n.base * base_bytes, n.adapters * 4)
    # FSDP over 2 ranks halves the base and the adapters (every dim 0 here is even).
    assert two.lora.base_bytes == n.base_bytes / 2 and two.lora.adapter_bytes == n.adapter_bytes / 2
    assert (two.grads, two.optimizer) == (one.grads / 2, one.optimizer / 2)
    assert two.lora.adapters == n.adapters and two.lora.base == n.base  # counts are whole-model
    # Against the full fine-tune of the same layout: far less state.
    full = estimate(load_config(None, [f"--model.hf_path={folders[kind]}", "--training.batch_size=2",
                                       "--data.seq_len=16", "--training.mixed_precision=bf16"]), 2)
    assert two.params + two.grads + two.optimizer < full.params + full.grads + full.optimizer
    assert full.lora is None


COLWISE_BASE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # base weight split on its output dim
ROWWISE_BASE = ("o_proj", "down_proj")  # on its input dim


def _tp_adapter_elems(kind: str, targets: list[str], r: int, tp: int) -> int:
    """Adapter elements one tp rank holds (before FSDP), from peft's lora_A / lora_B shapes
    and the rules of titanite/parallel/lora_tp.py: a column-parallel linear keeps A [r, in]
    whole and B [out/tp, r]; a row-parallel one A [r, in/tp] and B [out, r] whole; the experts
    (peft's ParamWrapper, one per targeted parameter) are not split by tp."""
    total, kinds = 0, set()
    for name, module in _peft_model(kind, targets, r).named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        if getattr(module, "parameter_name", None):  # experts: A [E r, in], B [out, E r]
            total += a.numel() + b.numel()
            kinds.add("experts")
            continue
        short = name.rsplit(".", 1)[-1]
        (rank, n_in), (n_out, rank_b) = a.shape, b.shape
        assert rank == rank_b == r, name
        if short in COLWISE_BASE:
            total += r * n_in + n_out * r // tp
        else:
            assert short in ROWWISE_BASE, name
            total += r * n_in // tp + n_out * r
        kinds.add(short)
    assert kinds, "peft adapted nothing"
    return total


@pytest.mark.parametrize("kind, names", [
    ("dense-wide", ["all-linear"]), ("dense-wide", ["q_proj", "down_proj"]), ("dense-wide", ["o_proj", "up_proj"]),
    ("moe-wide", ["all-linear"]), ("moe-wide", ["k_proj", "o_proj"]), ("moe-wide", ["v_proj", "experts.down_proj"]),
])
@pytest.mark.parametrize("dp_shard, tp", [(1, 2), (2, 2)])
def test_tensor_parallel_splits_the_adapters_like_their_base(folders, kind, names, dp_shard, tp):
    """Under tp the estimate holds per rank the adapters counted by hand from peft's shapes,
    FSDP-sharded over dp_shard (on the "-wide" models, where swapping a column- and a
    row-parallel split changes every projection's count); the frozen base is exactly the full
    fine-tune's parameters of the same layout (fp32 both), and only the adapters have gradients
    and moments."""
    r, world = 4, dp_shard * tp
    layout = [f"--parallelism.tp={tp}", f"--parallelism.dp_shard={dp_shard}"]
    e = estimate(_cfg(folders[kind], f"--lora.rank={r}", f"--lora.target_modules={','.join(names)}",
                      "--lora.base_dtype=fp32", *layout), world)
    assert (e.dims.tp, e.dims.dp_shard) == (tp, dp_shard)
    expected = _tp_adapter_elems(kind, names, r, tp)
    assert expected % dp_shard == 0  # every dim 0 here divides: no FSDP padding
    print(f"{kind} {names} dp_shard={dp_shard} tp={tp}: estimate {e.lora.adapter_bytes / 4:.0f} adapter "
          f"elements per rank, by hand {expected // dp_shard} (of {e.lora.adapters} in all)")
    assert e.lora.adapter_bytes == expected // dp_shard * 4
    assert e.lora.adapters == _peft_trainable(kind, names, r)  # the whole-model count ignores the layout
    assert (e.grads, e.optimizer) == (e.lora.adapter_bytes, 2 * e.lora.adapter_bytes)
    full = estimate(load_config(None, [f"--model.hf_path={folders[kind]}", "--training.batch_size=2",
                                       "--data.seq_len=16", *layout]), world)
    assert e.lora.base_bytes == full.params
    assert e.params == full.params + e.lora.adapter_bytes


def test_tensor_parallel_keeps_the_adapters_whole_rank_values(folders):
    """Under tp each adapted linear still keeps A's output [r] per token of the micro-batch
    (gathered sequence for a column-parallel linear, a full-width partial sum for a row-parallel
    one); under 'selective' also B's output, split over tp for a column-parallel linear only."""
    tokens, layers, r = 2 * 16, 2, 4
    tp2 = ["--parallelism.tp=2", f"--lora.rank={r}"]

    def acts(targets: str, *extra: str) -> float:
        return estimate(_cfg(folders["dense"], f"--lora.target_modules={targets}", *tp2, *extra), 2).activations

    # v_proj (column-parallel) and o_proj (row-parallel): each its own A output. Their inputs are
    # kept for q_proj's adapter and attention's backward anyway.
    assert acts("q_proj,v_proj") - acts("q_proj") == tokens * layers * r * 4
    assert acts("q_proj,o_proj") - acts("q_proj") == tokens * layers * r * 4
    selective = "--parallelism.activation_checkpoint=selective"
    hidden, kv = 32, 2 * 8  # o_proj's B out (whole: a partial sum), v_proj's (split over tp)
    assert acts("o_proj", selective) - acts("v_proj", selective) == tokens * layers * (hidden - kv // 2) * 4
    # Still below the full fine-tune of the layout: its frozen norms and matmuls keep less.
    full = estimate(load_config(None, [f"--model.hf_path={folders['dense']}", "--training.batch_size=2",
                                       "--data.seq_len=16", "--parallelism.tp=2"]), 2)
    assert acts("all-linear") < full.activations


def test_expert_parallel_splits_the_expert_adapters(folders):
    cfg = _cfg(folders["moe"], "--lora.target_modules=experts.gate_up_proj,experts.down_proj",
               "--parallelism.ep=2", "--lora.rank=4")
    n = estimate(cfg, 2).lora
    # ep = dp_shard = 2: the experts (and their adapters) are split over ep, not FSDP-sharded.
    assert n.adapter_bytes == n.adapters * 4 / 2


def test_activations_add_the_adapters_values(folders):
    """Per adapted dense linear and token, A's output [r]; with dropout, A's dropped input and
    its mask, while the shared input is no longer kept for it. The MoE layers keep their
    effective expert weights without checkpointing, and only as transient with it."""
    q_only = _cfg(folders["dense"], "--lora.target_modules=q_proj", "--lora.rank=4")
    both = _cfg(folders["dense"], "--lora.target_modules=q_proj,v_proj", "--lora.rank=4")
    tokens, layers, hidden = 2 * 16, 2, 32
    assert estimate(both, 1).activations - estimate(q_only, 1).activations == tokens * layers * 4 * 4
    dropped = _cfg(folders["dense"], "--lora.target_modules=q_proj", "--lora.rank=4", "--lora.dropout=0.1")
    assert (estimate(dropped, 1).activations - estimate(q_only, 1).activations
            == tokens * layers * hidden * (4 + 1 - 4))
    experts = ["--lora.target_modules=experts.down_proj", "--lora.rank=4"]
    plain, ckpt = (estimate(_cfg(folders["moe"], *experts, f"--parallelism.activation_checkpoint={ac}"), 2)
                   for ac in ("none", "full"))
    stack = 4 * 16 * 32 * 4  # layer 0's experts' down_proj: E x moe_intermediate x hidden, fp32
    assert ckpt.transient - plain.transient == stack  # rebuilt in the recomputed block


def _saved_bytes(folder: str, lo, batch: int, seq: int) -> int:
    """Bytes autograd keeps for backward over one forward of the native model with `lo`'s
    adapters (distinct storages, the parameters' own left out)."""
    import json
    from pathlib import Path

    from titanite.models.lora import freeze_base, init_adapters, native
    from titanite.models.qwen3.args import from_hf_config
    from titanite.models.qwen3.model import Qwen3

    torch.manual_seed(0)
    model = Qwen3(from_hf_config(json.loads((Path(folder) / "config.json").read_text())))
    model.init_weights()
    targets = native.apply(model, lo)
    init_adapters(model, targets, lo, seed=0)
    freeze_base(model, targets, lo.base_dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids)
    loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("kind, names, rel", [
    ("dense", "all-linear", 0.03), ("dense", "q_proj,v_proj", 0.03), ("moe", "all-linear", 0.03),
    ("moe", "q_proj,v_proj", 0.03),
    # Block 0 keeps less again where its attention has no adapter on a path (counted as kept):
    ("moe", "v_proj,experts.gate_up_proj,experts.down_proj", 0.08),  # its q and k paths
    ("moe", "o_proj,experts.gate_up_proj", 0.2),  # all of its attention but the output
])
def test_activations_match_the_native_model(folders, kind, names, rel):
    """Without checkpointing: the frozen base keeps less than a full fine-tune (no norm
    weights' or frozen matmuls' inputs), the adapters their own values, the MoE layers their
    effective expert weights. Never below what is kept, and close to it: the one gap is block
    0, whose input needs no gradient (a share of 1 / num_layers, large with the 2 blocks here)."""
    batch, seq = 2, 64
    cfg = load_config(None, [f"--model.hf_path={folders[kind]}", "--lora.enabled=true", "--lora.rank=4",
                             f"--lora.target_modules={names}", f"--training.batch_size={batch}",
                             f"--data.seq_len={seq}", "--kernels.loss=chunked"])
    e, measured = estimate(cfg, 1).activations, _saved_bytes(folders[kind], cfg.lora, batch, seq)
    print(f"{kind} {names}: estimate {e:.0f} B, saved for backward {measured} B")
    assert measured <= e <= measured * (1 + rel)


def test_report_labels_frozen_base_and_adapters(folders, capsys):
    assert estimate_main([f"--model.hf_path={folders['moe']}", "--lora.enabled=true", "--lora.rank=4",
                          "--world-size=2"]) == 0
    out = capsys.readouterr().out
    n = estimate(_cfg(folders["moe"], "--lora.rank=4"), 2).lora
    print(out)
    assert f"{n.adapters:,} trainable parameters (adapters) of {n.total:,} total ({n.base:,} frozen base" in out
    for row in ("parameters: frozen base (fp32, sharded)", "parameters: adapters (fp32, sharded)",
                "gradients (adapters only", "optimizer (AdamW, adapters only", "effective expert weights", "peak"):
        assert row in out


@pytest.mark.parametrize("kind, extra, message", [
    ("dense", ["--lora.target_modules=lm_head"], r"'lm_head' cannot carry an adapter"),
    ("dense", ["--lora.target_modules=experts.down_proj"], r"'experts.down_proj' is not a module this model has"),
    ("moe", ["--lora.dropout=0.1"], r"lora.dropout' is 0.1 but MoE experts are targeted"),
    ("moe", ["--lora.target_modules=q_proj,up_proj"], r"'up_proj' in an MoE model is ambiguous"),
])
def test_targets_are_checked_as_training_checks_them(folders, kind, extra, message):
    with pytest.raises(UserError, match=message):
        estimate(_cfg(folders[kind], *extra), 1)


@pytest.mark.parametrize("kind, names", [("dense", ["all-linear"]), ("dense", ["q_proj", "v_proj"]),
                                         ("moe", ["all-linear"]), ("moe", ["k_proj", "o_proj"])])
def test_estimated_flops_are_the_trainer_s(folders, kind, names):
    """The estimate's FLOPs per step are what the trainer's MFU counts for the built LoRA model
    (ModelHandle.flops_per_token, itself checked against torch's FLOP counter in test_lora_training.py)."""
    from titanite.models.spec import get_spec

    cfg = _cfg(folders[kind], f"--lora.target_modules={','.join(names)}", "--lora.rank=2")
    handle = get_spec(cfg.model.spec).build(cfg.model)
    handle.apply_lora(cfg.lora)
    e = estimate(cfg, 1)
    assert e.flops_per_step == pytest.approx(handle.flops_per_token(cfg.data.seq_len) * e.tokens_per_step, rel=1e-12)
    full = estimate(_cfg(folders[kind], "--lora.enabled=false"), 1)
    assert e.flops_per_step < full.flops_per_step  # rank 2: adapters small beside this tiny base

"""LoRA for the native model: adapter modules written in titanite, at peft's places, with
peft's math.

- `LoraLinear` replaces a block's nn.Linear and keeps its `weight` under the same state-dict
  key, so the Hugging Face mapping of the base is unchanged; the adapters are its children
  `lora_A` [r, in] and `lora_B` [out, r]:  y = x W^T + scale * B(A(dropout(x))), as peft's
  lora.Linear.
- `LoraGroupedExperts` adds per-expert factors to the fused experts and runs the `moe.experts`
  kernel op on W + scale * B @ A (one baddbmm per projection), as peft does for transformers'
  fused experts. The factors are stacked on the expert dim [E, ...], so expert parallelism
  shards them with the experts.

- Gated DeltaNet (Qwen3.5, Qwen3-Next) fuses its input projections natively (w_qkvz, w_ba;
  models/qwen3/hybrid.py), where transformers has one module per block (Qwen3.5's in_proj_qkv,
  in_proj_z, in_proj_b, in_proj_a) or per fused pair, interleaved per key head (Qwen3-Next's
  in_proj_qkvz, in_proj_ba). Each Hugging Face module keeps its own adapter, exactly as peft's:
  Qwen3.5's as `LoraRowBlocks`, one adapter per row block of the fused weight; Qwen3-Next's as a
  `LoraLinear` whose B rows are stored in native order and converted to and from transformers'
  interleaved order (a permutation of rows, so B's rows map to the fused rows block by block).

Names: native `layers.{i}.attention.wq` is Hugging Face `model.layers.{i}.self_attn.q_proj`,
and so on (the tables below, the same as the state-dict adapter's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanite.core.config import LoraConfig
from titanite.models.lora import EXPERT_TARGETS, LoraTarget, check_dropout, chosen_targets, scale
from titanite.models.qwen3.hybrid import GatedDeltaNet
from titanite.models.qwen3.hybrid_state_dict import HybridStateDictAdapter
from titanite.models.qwen3.moe import GroupedExperts

# native attribute path inside a block -> Hugging Face module name inside model.layers.{i}.
_LINEAR = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
}
_EXPERT_PARAMS = {"w_gate_up": "gate_up_proj", "w_down": "down_proj"}
_ATTENTION = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
_MLP = ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2")


class LoraLinear(nn.Linear):
    """A frozen linear (bias-free) plus a rank-r adapter."""

    def __init__(self, base: nn.Linear, rank: int, s: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", None)
        factory = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **factory)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scale = s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if not self.scale:  # adapters switched off (a DPO reference's forward): the base alone
            return y
        return y + self.lora_B(self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype)))) * self.scale


class LoraRowBlocks(nn.Linear):
    """A frozen fused linear (bias-free) whose row blocks are separate Hugging Face modules, each
    with its own rank-r adapter (or none): y = x W^T + scale * concat_p(B_p(A_p(dropout_p(x)))),
    zeros for a block without one. That is peft's math on each module: its own dropout mask, drawn
    in the blocks' order, as transformers calls them. Adapters in ModuleDicts by the block's
    Hugging Face name: lora_A[name] [r, in], lora_B[name] [rows, r]."""

    def __init__(self, base: nn.Linear, blocks: list[tuple[str, int]], adapted: set[str], rank: int, s: float,
                 dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        assert sum(rows for _, rows in blocks) == self.out_features, (blocks, self.out_features)
        self.weight = base.weight
        self.register_parameter("bias", None)
        self.blocks = blocks
        factory = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.ModuleDict({n: nn.Linear(self.in_features, rank, bias=False, **factory)
                                     for n, _ in blocks if n in adapted})
        self.lora_B = nn.ModuleDict({n: nn.Linear(rank, rows, bias=False, **factory)
                                     for n, rows in blocks if n in adapted})
        self.dropout = nn.ModuleDict({n: nn.Dropout(dropout) if dropout else nn.Identity() for n in self.lora_A})
        self.scale = s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if not self.scale:  # adapters switched off (a DPO reference's forward): the base alone
            return y
        xa = x.to(torch.float32)
        parts = [self.lora_B[n](self.lora_A[n](self.dropout[n](xa))) if n in self.lora_A
                 else xa.new_zeros(*x.shape[:-1], rows) for n, rows in self.blocks]
        return y + torch.cat(parts, dim=-1) * self.scale


class LoraGroupedExperts(GroupedExperts):
    """GroupedExperts whose chosen projections (`adapted`: 'w_gate_up', 'w_down') carry
    per-expert adapters: lora_<p>_A [E, r, in], lora_<p>_B [E, out, r]."""

    def __init__(self, base: GroupedExperts, adapted: list[str], rank: int, s: float) -> None:
        nn.Module.__init__(self)
        self.w_gate_up, self.w_down, self.kernel = base.w_gate_up, base.w_down, base.kernel
        self.adapted, self.scale = tuple(adapted), s
        for name in adapted:
            e, out, inp = getattr(self, name).shape
            device = getattr(self, name).device
            self.register_parameter(f"lora_{name}_A", nn.Parameter(torch.empty(e, rank, inp, device=device)))
            self.register_parameter(f"lora_{name}_B", nn.Parameter(torch.empty(e, out, rank, device=device)))

    def effective(self, name: str) -> torch.Tensor:
        w = getattr(self, name)
        if name not in self.adapted or not self.scale:  # not adapted, or adapters switched off
            return w
        a, b = getattr(self, f"lora_{name}_A"), getattr(self, f"lora_{name}_B")
        # In the base's dtype, outside autocast, as peft folds it: the kernel op then casts the
        # effective weight for compute like any other weight.
        with torch.autocast(device_type=w.device.type, enabled=False):
            return torch.baddbmm(w, b.to(w.dtype), a.to(w.dtype), alpha=self.scale)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, counts, self.effective("w_gate_up"), self.effective("w_down"))


def _linear_attention(model: nn.Module, block: GatedDeltaNet) -> list[tuple[str, list[tuple[str, int]], bool]]:
    """(native path, [(HF module, rows)], whether the rows are in another order) of a Gated DeltaNet
    block's projections: row blocks of w_qkvz / w_ba for Qwen3.5, the whole weight interleaved
    per key head for Qwen3-Next."""
    keys = block.key_heads * block.key_dim
    values, heads = block.value_heads * block.value_dim, block.value_heads
    if model.args.model_type == "qwen3_next":
        qkvz = [("linear_attn.in_proj_qkvz", 2 * keys + 2 * values)]
        return [("attention.w_qkvz", qkvz, True), ("attention.w_ba", [("linear_attn.in_proj_ba", 2 * heads)], True),
                ("attention.wo", [("linear_attn.out_proj", values)], False)]
    return [("attention.w_qkvz", [("linear_attn.in_proj_qkv", 2 * keys + values), ("linear_attn.in_proj_z", values)],
             False),
            ("attention.w_ba", [("linear_attn.in_proj_b", heads), ("linear_attn.in_proj_a", heads)], False),
            ("attention.wo", [("linear_attn.out_proj", values)], False)]


def _table(model: nn.Module, block: nn.Module) -> list[tuple[str, list[tuple[str, int]], bool]]:
    """Every adaptable linear of a block, as _linear_attention describes them."""
    mixer = (_linear_attention(model, block.attention) if isinstance(block.attention, GatedDeltaNet)
             else [(p, [(_LINEAR[p], 0)], False) for p in _ATTENTION])
    return [(p, hf, mixed) for p, hf, mixed in mixer + [(p, [(_LINEAR[p], 0)], False) for p in _MLP]
            if _find(block, p) is not None]


def _leaf(hf: str) -> str:
    return hf.split(".")[-1]


def available(model: nn.Module) -> set[str]:
    """The target_modules names this native model has."""
    names = set()
    for block in model.layers:
        names.update(_leaf(hf) for _, blocks, _ in _table(model, block) for hf, _ in blocks)
        if isinstance(getattr(block.feed_forward, "experts", None), GroupedExperts):
            names.update(EXPERT_TARGETS)
    return names


def _find(block: nn.Module, path: str) -> nn.Linear | None:
    module = block
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module if isinstance(module, nn.Linear) else None


def _reordered(model: nn.Module, path: str) -> dict:
    """Converters of a Qwen3-Next projection's B between native row order (stored) and
    transformers' per-key-head interleaving (canonical): a permutation of rows."""
    sd = HybridStateDictAdapter(model.args)
    blocks = sd._qkvz_blocks() if path.endswith("w_qkvz") else sd._ba_blocks()
    return {"b_canonical": lambda b: sd._interleave(b, blocks), "b_backend": lambda b: sd._deinterleave(b, blocks)}


def apply(model: nn.Module, cfg: LoraConfig) -> list[LoraTarget]:
    """Put the adapters into the (meta-device) native model in place; returns them in a fixed
    order (layer, then the tables' order)."""
    wanted = chosen_targets(cfg, available(model))
    check_dropout(cfg, wanted)
    s = scale(cfg)
    targets: list[LoraTarget] = []
    for i, block in enumerate(model.layers):
        for path, blocks, reordered in _table(model, block):
            adapted = [hf for hf, _ in blocks if _leaf(hf) in wanted]
            if not adapted:
                continue
            base, where = _find(block, path), f"layers.{i}.{path}"
            parent_path, attr = path.rsplit(".", 1)
            if len(blocks) == 1:
                setattr(block.get_submodule(parent_path), attr, LoraLinear(base, cfg.rank, s, cfg.dropout))
                extra = _reordered(model, path) if reordered else {}
                targets.append(LoraTarget(f"model.layers.{i}.{blocks[0][0]}",
                                          f"{where}.weight" if not reordered else f"{where}.weight (reordered)",
                                          f"{where}.lora_A.weight", f"{where}.lora_B.weight",
                                          merge_in_hf=reordered, **extra))
                continue
            leaves = [(_leaf(hf), rows) for hf, rows in blocks]
            setattr(block.get_submodule(parent_path), attr,
                    LoraRowBlocks(base, leaves, {_leaf(hf) for hf in adapted}, cfg.rank, s, cfg.dropout))
            start = 0
            for hf, rows in blocks:  # base: the block's rows of the fused weight, not a state-dict key
                if hf in adapted:
                    targets.append(LoraTarget(f"model.layers.{i}.{hf}", f"{where}.weight[{start}:{start + rows}]",
                                              f"{where}.lora_A.{_leaf(hf)}.weight",
                                              f"{where}.lora_B.{_leaf(hf)}.weight", merge_in_hf=True))
                start += rows
        experts = getattr(block.feed_forward, "experts", None)
        adapted = [p for p, hf in _EXPERT_PARAMS.items() if f"experts.{hf}" in wanted]
        if isinstance(experts, GroupedExperts) and adapted:
            wrapped = LoraGroupedExperts(experts, adapted, cfg.rank, s)
            block.feed_forward.experts = wrapped
            for p in adapted:
                where = f"layers.{i}.feed_forward.experts"
                targets.append(LoraTarget(f"model.layers.{i}.mlp.experts.{_EXPERT_PARAMS[p]}", f"{where}.{p}",
                                          f"{where}.lora_{p}_A", f"{where}.lora_{p}_B", experts=True))
    return targets

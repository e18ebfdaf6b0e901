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

Names: native `layers.{i}.attention.wq` is Hugging Face `model.layers.{i}.self_attn.q_proj`,
and so on (the table below, the same as the state-dict adapter's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanite.core.config import LoraConfig
from titanite.models.lora import EXPERT_TARGETS, LoraTarget, check_dropout, chosen_targets, scale
from titanite.models.qwen3.moe import GroupedExperts

# native attribute path inside a block -> Hugging Face module name inside model.layers.{i}.
_LINEAR = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
}
_EXPERT_PARAMS = {"w_gate_up": "gate_up_proj", "w_down": "down_proj"}


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


def available(model: nn.Module) -> set[str]:
    """The target_modules names this native model has."""
    names = set()
    for block in model.layers:
        for path, hf in _LINEAR.items():
            if _find(block, path) is not None:
                names.add(hf.split(".")[-1])
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


def apply(model: nn.Module, cfg: LoraConfig) -> list[LoraTarget]:
    """Put the adapters into the (meta-device) native model in place; returns them in a fixed
    order (layer, then the table's order)."""
    wanted = chosen_targets(cfg, available(model))
    check_dropout(cfg, wanted)
    s = scale(cfg)
    targets: list[LoraTarget] = []
    for i, block in enumerate(model.layers):
        for path, hf in _LINEAR.items():
            base = _find(block, path)
            if base is None or hf.split(".")[-1] not in wanted:
                continue
            parent_path, attr = path.rsplit(".", 1)
            wrapped = LoraLinear(base, cfg.rank, s, cfg.dropout)
            setattr(block.get_submodule(parent_path), attr, wrapped)
            targets.append(LoraTarget(f"model.layers.{i}.{hf}", f"layers.{i}.{path}.weight",
                                      f"layers.{i}.{path}.lora_A.weight", f"layers.{i}.{path}.lora_B.weight"))
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

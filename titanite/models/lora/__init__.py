"""LoRA: low-rank adapters on a frozen base, the same on both backends.

Each backend puts adapters at the same places (titanite/models/lora/native.py for the native model,
peft on the transformers model in titanite/models/lora/hf.py) and describes each one as a
`LoraTarget`: its name in the Hugging Face layout and its A and B factors. Everything that is not
backend code works on those descriptions only:

- initialisation (`init_adapters`): B = 0, A drawn from a generator seeded by (job.seed, the
  target's name), so both backends and every layout start from the same adapters;
- the PEFT adapter folder (titanite/models/lora/adapter.py) and the merged export
  (ModelHandle.hf_state_dict(merged=True));
- the parameter counts the trainer logs.

The canonical factor shapes, which every backend converts to and from:
- a linear module `...q_proj` (weight [out, in]): A [r, in], B [out, r];
- a fused MoE experts parameter `...mlp.experts.gate_up_proj` ([E, out, in]): A [E, r, in],
  B [E, out, r]: one rank-r adapter per expert, as peft's adapters for transformers' fused
  experts.
The update is scale * B @ A with scale = alpha / rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from titanite.core.config import LORA_ALL, LoraConfig
from titanite.core.errors import UserError
from titanite.formats.sharded import copy_local, local_part, name_seed

# The Hugging Face names a target may use: dense linear modules, and the MoE experts' fused
# projections (parameters of the experts module, written "experts.<param>"). Qwen3.5's and
# Qwen3-Next's Gated DeltaNet layers (`linear_attn.*`) have their own projections: Qwen3.5's
# in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, Qwen3-Next's in_proj_qkvz / in_proj_ba, and
# out_proj in both.
LINEAR_ATTENTION_TARGETS = ("in_proj_qkvz", "in_proj_qkv", "in_proj_z", "in_proj_ba", "in_proj_b", "in_proj_a",
                            "out_proj")
LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", *LINEAR_ATTENTION_TARGETS, "gate_proj", "up_proj",
                  "down_proj")
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
KNOWN_TARGETS = LINEAR_TARGETS + EXPERT_TARGETS

Convert = Callable[[torch.Tensor], torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class LoraTarget:
    """One adapted weight.

    key: the adapted module's (linear) or parameter's (experts) name in the Hugging Face layout,
        e.g. "model.layers.0.self_attn.q_proj" or "model.layers.0.mlp.experts.gate_up_proj".
    base: the state-dict key of the frozen base weight in the backend's module.
    a, b: the parameter names of the factors in the backend's module (looked up when used:
        materialising and sharding replace the Parameter objects); `a_canonical`/`b_canonical`
        turn a full (gathered) factor into the canonical shape, `a_backend`/`b_backend` the
        other way.
    """

    key: str
    base: str
    a: str
    b: str
    experts: bool = False
    peft_module: str = ""  # hf backend: the peft LoRA layer's path in the transformers model
    a_canonical: Convert = _same
    b_canonical: Convert = _same
    a_backend: Convert = _same
    b_backend: Convert = _same
    # The native Gated DeltaNet's fused projections: the target is a row block of the fused base
    # weight (Qwen3.5's in_proj_qkv inside w_qkvz) or the whole of it in another row order
    # (Qwen3-Next's in_proj_qkvz). `base` then names no state-dict key (so ModelHandle's merge,
    # which adds B @ A to whole base weights, leaves it) and the backend's merged export adds
    # scale * B @ A to the Hugging Face tensor `key`.weight instead, which is exactly that weight.
    merge_in_hf: bool = False

    @property
    def short_name(self) -> str:
        """The target_modules name this target answers to (q_proj, experts.down_proj, ...)."""
        parts = self.key.split(".")
        return ".".join(parts[-2:]) if self.experts else parts[-1]


def is_adapter_key(name: str) -> bool:
    """True for a state-dict key of an adapter factor (either backend), not of the base."""
    return any(part.startswith("lora_") for part in name.split("."))


def base_key(name: str) -> str:
    """A base weight's state-dict key without peft's wrapper levels (`.base_layer`)."""
    return ".".join(p for p in name.split(".") if p != "base_layer")


class BaseWeightsAdapter:
    """A backend's state-dict adapter for the base of a LoRA model: adapter keys are not part of
    the Hugging Face layout, and peft's `.base_layer` levels are looked through."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def skips(self, name: str) -> bool:
        return is_adapter_key(name) or self.inner.skips(name)

    def to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return self.inner.to_hf(base_key(name), tensor)

    def from_hf(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        return self.inner.from_hf(base_key(name), tensors)

    def ignorable_hf_keys(self) -> set[str]:
        return self.inner.ignorable_hf_keys()


def scale(cfg: LoraConfig) -> float:
    return cfg.alpha / cfg.rank


DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


def chosen_targets(cfg: LoraConfig, available: Iterable[str]) -> set[str]:
    """The target_modules names to adapt, checked against the ones this model has
    (`available`, short names such as q_proj or experts.gate_up_proj).

    In an MoE model peft reads gate_proj / up_proj / down_proj as the experts' projections
    (their names before transformers 5 fused them) and rewrites them into expert targets, so an
    adapter on a dense MLP layer of an MoE model (mlp_only_layers) could not be loaded by peft:
    those layers are left to their base weights."""
    have = set(available)
    moe = any(n in EXPERT_TARGETS for n in have)
    if moe:
        have -= set(DENSE_MLP)
    if LORA_ALL in cfg.target_modules:
        if len(cfg.target_modules) > 1:
            raise UserError(f"config key 'lora.target_modules': '{LORA_ALL}' already names every module; "
                            f"list it alone, got {cfg.target_modules}")
        return have
    listed = [n for n in KNOWN_TARGETS if n in have]
    for name in cfg.target_modules:
        if name in ("lm_head", "embed_tokens", "gate", "mlp.gate"):
            raise UserError(f"config key 'lora.target_modules': '{name}' cannot carry an adapter (only the "
                            f"projections do); this model has: {', '.join(listed)}")
        if moe and name in DENSE_MLP:
            raise UserError(f"config key 'lora.target_modules': '{name}' in an MoE model is ambiguous: peft "
                            "reads it as the experts' projection; name experts.gate_up_proj or "
                            f"experts.down_proj instead (this model has: {', '.join(listed)})")
        if name not in have:
            what = "is not a module this model has" if name in KNOWN_TARGETS else "is not a module name titanite knows"
            raise UserError(f"config key 'lora.target_modules': '{name}' {what}; this model has: "
                            f"{', '.join(listed)} (or '{LORA_ALL}')")
    return set(cfg.target_modules)


def check_dropout(cfg: LoraConfig, wanted: set[str]) -> None:
    """Before any adapter is made: dropout cannot act on expert adapters."""
    experts = sorted(n for n in wanted if n in EXPERT_TARGETS)
    if cfg.dropout and experts:
        raise UserError(f"config key 'lora.dropout' is {cfg.dropout} but MoE experts are targeted "
                        f"({', '.join(experts)}): an experts "
                        "adapter is folded into the expert weights, where input dropout has no place (peft "
                        "refuses it too); set lora.dropout = 0 or leave the experts out of target_modules")


def dropout_seed(seed: int, step: int, micro: int, rank: int, stage: int | None = None) -> int:
    """The seed of every generator (host and device) for one micro-batch's adapter dropout: a
    function of where the run is, not of what ran before, so a resumed run draws the masks the
    uninterrupted run drew, on any device, and each data-parallel rank draws its own (and, under
    pipeline parallelism, each stage: its first layer's index)."""
    if stage is None:
        return name_seed("titanite-lora-dropout", seed, step, micro, rank)
    return name_seed("titanite-lora-dropout", seed, step, micro, rank, stage)


def draw_a(shape: tuple[int, ...], seed: int, key: str, init: str, rank: int) -> torch.Tensor:
    """The initial A (canonical shape, fp32, on CPU) for target `key`: Kaiming-uniform with
    a = sqrt(5) over the input dim (bound 1/sqrt(in), as peft's default) or normal(0, 1/rank)."""
    g = torch.Generator().manual_seed(name_seed("titanite-lora", seed, key))
    if init == "gaussian":
        return torch.randn(shape, generator=g) / rank
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.rand(shape, generator=g).mul_(2 * bound).sub_(bound)


def factors(module: nn.Module, t: LoraTarget) -> tuple[nn.Parameter, nn.Parameter]:
    """The target's (A, B) parameters in `module`, as the backend stores them."""
    return module.get_parameter(t.a), module.get_parameter(t.b)


@torch.no_grad()
def init_adapters(module: nn.Module, targets: list[LoraTarget], cfg: LoraConfig, seed: int) -> None:
    """B = 0 and A drawn per target from (seed, key), whole (a factor is small), into the
    materialised factors: each rank keeps its shard, so every layout starts the same."""
    for t in targets:
        a, b = factors(module, t)
        shape = tuple(t.a_canonical(torch.empty(a.shape, device="meta")).shape)
        copy_local(a, t.a_backend(draw_a(shape, seed, t.key, cfg.init, cfg.rank)))
        local_part(b).zero_()


def freeze_base(module: nn.Module, targets: list[LoraTarget], base_dtype: str) -> None:
    """Only the adapters train; the base is stored in `base_dtype` (before materialising)."""
    adapters = {id(p) for t in targets for p in factors(module, t)}
    dtype = torch.bfloat16 if base_dtype == "bf16" else torch.float32
    for p in module.parameters():
        if id(p) in adapters:
            p.requires_grad_(True)
            continue
        p.requires_grad_(False)
        if p.dtype != dtype and p.dtype.is_floating_point:
            p.data = p.data.to(dtype)


def delta(t: LoraTarget, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """scale * B @ A in the base weight's in-memory layout ([out, in] or [E, out, in]), fp32,
    from full canonical factors."""
    a, b = a.float(), b.float()
    return s * (torch.bmm(b, a) if t.experts else b @ a)


def counts(module: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; shared storage (a tied head) counted once."""
    seen: dict[int, tuple[int, bool]] = {}
    for p in module.parameters():
        seen[id(p)] = (p.numel(), p.requires_grad)
    return sum(n for n, g in seen.values() if g), sum(n for n, _ in seen.values())

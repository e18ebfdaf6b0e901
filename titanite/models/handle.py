"""The model handle: one built model and everything titanite knows about it.

A backend's `build(ModelConfig)` returns a `ModelHandle` subclass holding the `nn.Module`, the
architecture (`Qwen3Args`), the source `config.json` and the options that act after the build.
Everything a caller asks about a model goes through the handle: its Hugging Face config, names
and tensors, FLOPs per token, how the estimate should count its activations, what it supports
(generation, document masks, expert parallelism) and how its loss is computed. Nothing is
stored on the `nn.Module`; `handle_of(module)` finds the handle of a module a backend built.

The model layer is single-device code: handles never import `titanite.parallel` or
`torch.distributed`. Where a step needs a collective (gathering a sharded tensor for an export,
summing expert counts over ranks), the caller passes it in as a function.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from titanite.core.config import KernelsConfig, LoraConfig
from titanite.formats.hf_weights import StateDictAdapter, check_hf_weights, load_with_adapter
from titanite.formats.sharded import RandomSource, RegionGather, fill, gather_whole, hf_pieces, local_regions
from titanite.models import lora
from titanite.models.flops import flops_per_token, lora_flops_per_token
from titanite.models.qwen3.args import Qwen3Args
from titanite.models.stage import Part, keep_parts

Gather = Callable[[torch.Tensor], torch.Tensor]  # a sharded tensor -> the full tensor (a collective)
AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sum over every rank, in place


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class TrainOutput:
    """What one training forward returns to the trainer."""

    logits: torch.Tensor | None  # [B, S, V]; None when loss_sum is given
    aux_loss: torch.Tensor | None = None  # already scaled by its coefficient; added to the loss
    # telemetry (e.g. expert load) as 0-dim device tensors, read on the host only when logged
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    # fp32 cross-entropy summed over the batch's valid labels, when the model computes it itself
    # (the `loss` kernel op, without materialising the logits); the trainer then skips its own.
    loss_sum: torch.Tensor | None = None
    # a MoE model's routing per MoE layer (RoutingRecord; pooled over context-parallel ranks),
    # for the load-balancing loss at model.aux_loss_scope (titanite/models/moe_balance.py)
    routing: list | None = None


@dataclass(frozen=True)
class ActivationProfile:
    """How `titanite estimate` counts what a training forward keeps for backward."""

    sequence_parallel: bool  # under tensor parallelism the residual stream is sharded over the sequence
    keeps_logits: bool  # the [tokens, V] logits (and their log-softmax) live until backward


@dataclass(frozen=True)
class ModelOptions:
    """[model] settings that act after the build."""

    moe_bias_update_rate: float = 0.0


@dataclass
class Lora:
    """A LoRA model's adapters (see titanite/models/lora)."""

    cfg: LoraConfig
    targets: list[lora.LoraTarget]  # those the module holds (a pipeline stage's: its layers')
    every: list[lora.LoraTarget] | None = None  # the whole model's, when the module holds fewer

    @property
    def all_targets(self) -> list[lora.LoraTarget]:
        return self.every if self.every is not None else self.targets


# The module keeps its handle as an attribute: a cycle the garbage collector frees once neither is
# used (a registry keyed by the module would keep every model built in the process alive, since
# its value, the handle, holds the module).
_HANDLE_ATTR = "_titanite_handle"


def handle_of(module: nn.Module) -> ModelHandle:
    """The handle of a module that a titanite backend built (by `titanite.load_pretrained`, a
    trainer, or `ModelSpec.build`)."""
    handle = module.__dict__.get(_HANDLE_ATTR)
    if handle is None:
        raise TypeError(f"{type(module).__name__} was not built by titanite (titanite.load_pretrained or a "
                        "model spec's build); cannot tell its backend and Hugging Face layout")
    return handle


class ModelHandle(ABC):
    """One built model. Subclasses are the backends; see the module docstring."""

    backend: ClassVar[str]  # the `model.spec` name
    supports_document_masks: ClassVar[bool] = False  # forward_train honours batch["document_ids"]
    supports_generation: ClassVar[bool] = False  # native KV-cache decoding (titanite generate)
    supports_expert_parallel: ClassVar[bool] = False
    # The model's head has a `loss` kernel call site: forward_train can return the summed
    # cross-entropy from the hidden states (loss_sum) instead of the logits.
    fused_loss: ClassVar[bool] = False

    def __init__(self, module: nn.Module, args: Qwen3Args, source_config: dict[str, Any] | None,
                 source_folder: str = "", options: ModelOptions = ModelOptions()) -> None:
        self.module = module
        self.args = args
        self.source_config = source_config  # the checkpoint's config.json, None for a flavor
        self.source_folder = source_folder  # where the weights came from (generation/tokenizer files)
        self.options = options
        # Set by the tensor-parallel plan: the head is sharded over the vocabulary, so the loss
        # comes from sharded logits (loss_parallel), not from the fused loss op.
        self.vocab_parallel = False
        self.lora: Lora | None = None  # set by apply_lora
        self.stage_parts: list[Part] | None = None  # set by keep_parts: the pipeline stages the module holds
        self._whole: dict[str, Any] = {}  # the whole model's counts, kept by keep_parts
        module.__dict__[_HANDLE_ATTR] = self

    # -- what the model is -----------------------------------------------------------------

    @abstractmethod
    def hf_config(self) -> dict[str, Any]:
        """The config.json dict an HF export of this model carries."""

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, attention included; a LoRA model's
        frozen weights are counted without their weight gradients."""
        if self.lora is None:
            return flops_per_token(self.args, seq_len)
        linear, experts, first_qkv = self._whole["lora"] if "lora" in self._whole else self._lora_counts()
        return lora_flops_per_token(self.args, seq_len, linear, experts, first_qkv)

    def _lora_counts(self) -> tuple[int, bool, int]:
        numel = self.module.get_parameter
        targets = self.lora.targets
        linear = sum(numel(t.a).numel() + numel(t.b).numel() for t in targets if not t.experts)
        first_qkv = sum(numel(t.a).numel() for t in targets
                        if t.key.startswith("model.layers.0.") and t.short_name in ("q_proj", "k_proj", "v_proj"))
        return linear, any(t.experts for t in targets), first_qkv

    def num_params(self) -> int:
        """The whole model's parameters (a pipeline stage's module holds fewer)."""
        return self._whole.get("params") or sum(p.numel() for p in self.module.parameters())

    @abstractmethod
    def activation_profile(self, kernels_cfg: KernelsConfig, tp: int) -> ActivationProfile:
        """How the estimate counts this model's activations under `tp` with these kernels."""

    @property
    def loss_from_logits(self) -> bool:
        """True when the trainer computes the cross-entropy from the logits forward_train
        returns; False when the model's `loss` op returns the summed loss itself. The loss op
        needs the whole head matrix, so a vocabulary-sharded head (tensor parallel) gives
        sharded logits, whose cross-entropy the trainer computes across the shards."""
        return not self.fused_loss or self.vocab_parallel

    def keeps_logits(self, kernels_cfg: KernelsConfig, tp: int) -> bool:
        """Whether a training forward holds the [tokens, V] logits until backward: all but the
        chunked loss op on a whole head do."""
        return not (self.fused_loss and tp == 1 and kernels_cfg.select.get("loss", "chunked") == "chunked")

    # -- weights ---------------------------------------------------------------------------

    @abstractmethod
    def state_dict_adapter(self) -> StateDictAdapter:
        """The mapping between this model's state-dict keys and the Hugging Face on-disk keys."""

    def base_adapter(self) -> StateDictAdapter:
        """The mapping of the base weights: with LoRA, adapter keys are left out and peft's
        wrapper levels (`.base_layer`) are looked through."""
        inner = self.state_dict_adapter()
        return inner if self.lora is None else lora.BaseWeightsAdapter(inner)

    def check_hf(self, folder: str) -> None:
        """Every check load_hf makes before reading data (names, shapes, dtypes); works on the
        meta-device model."""
        check_hf_weights(self.module, self.base_adapter(), folder)

    def load_hf(self, folder: str) -> None:
        """Copy the weights of a local HF folder into the materialised model (the base of a
        LoRA model; its adapters are left as they are)."""
        load_with_adapter(self.module, self.base_adapter(), folder, whole=self.stage_parts is None)
        self.init_buffers()

    def hf_state_dict(self, regions: RegionGather | None = None,
                      merged: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF key, tensor) pairs in the on-disk Hub layout, one at a time. `regions` gathers the
        parts of a sharded tensor that each on-disk tensor is (one expert's matrix of the fused
        experts, a q/k/v block), so no rank ever holds a whole fused tensor (sharded.hf_pieces);
        every rank walks the same keys, so its collectives line up. `merged` (LoRA): each
        adapted weight is W + scale * B @ A; otherwise the base as loaded."""
        adapter, regions = self.base_adapter(), regions or local_regions
        merge = {t.base: t for t in self.lora.targets} if merged and self.lora is not None else {}
        for name, tensor in self.module.state_dict().items():
            if self.is_alias(name) or adapter.skips(name):
                continue
            if name not in merge:
                yield from hf_pieces(name, tensor, adapter, regions)
                continue
            full = gather_whole(regions, name, tensor)
            a, b = self._full_factors(merge[name], functools.partial(gather_whole, regions, name))
            full = (full.float() + lora.delta(merge[name], a, b, lora.scale(self.lora.cfg))).to(full.dtype)
            yield from adapter.to_hf(name, full)

    def adapter_factors(self, gather: Gather | None = None) -> Iterator[tuple[lora.LoraTarget, torch.Tensor, torch.Tensor]]:
        """(target, A, B) for every adapter, full and in the canonical shapes (titanite/models/lora)."""
        assert self.lora is not None, "not a LoRA model"
        for t in self.lora.targets:
            yield (t, *self._full_factors(t, gather or _identity))

    def _full_factors(self, t: lora.LoraTarget, gather: Gather) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = lora.factors(self.module, t)
        return t.a_canonical(gather(a.detach())), t.b_canonical(gather(b.detach()))

    def apply_lora(self, cfg: LoraConfig) -> None:
        """Put adapters into the meta-device model and freeze (and cast) the base."""
        targets = self._inject_lora(cfg)
        lora.freeze_base(self.module, targets, cfg.base_dtype)
        self.lora = Lora(cfg, targets)

    def _inject_lora(self, cfg: LoraConfig) -> list[lora.LoraTarget]:
        """Put the backend's adapters in place; the targets in a fixed order (layer, projection)."""
        from titanite.core.errors import UserError

        raise UserError(f"config key 'lora.enabled': model.spec = '{self.backend}' has no LoRA support")

    def is_alias(self, name: str) -> bool:
        """True for a state-dict key that is another key's tensor under a second name (a tied
        head), which an export writes once."""
        return False

    def init_weights(self, std: float, seed: int) -> None:
        """Seeded random init of the materialised, possibly sharded, model (the base of a LoRA
        model): normal(0, std) matrices, ones for norms, each Hugging Face tensor drawn from
        (seed, its key), so the weights do not depend on the layout or the backend."""
        fill(self.module, self.base_adapter(), self.random_source(seed, std))
        self.init_buffers()

    def random_source(self, seed: int, std: float) -> RandomSource:
        """Where init_weights draws each Hugging Face tensor from (a backend with other init
        rules, e.g. zero-centred norms, returns its own)."""
        return RandomSource(seed, std)

    @abstractmethod
    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (e.g. RoPE inv_freq) after materialising/loading."""

    # -- training --------------------------------------------------------------------------

    def attach_kernels(self, kernels_cfg: KernelsConfig, device_type: str, dtype: torch.dtype) -> dict[str, str]:
        """Bind the model's kernel call sites from the `[kernels]` table; returns {call site:
        "op:implementation"}. Backends whose modules hold no call sites of their own add them first."""
        from titanite.kernels import attach

        return attach(self.module, kernels_cfg.select, device_type, dtype, kernels_cfg.fallback)

    @abstractmethod
    def forward_train(self, batch: dict[str, torch.Tensor]) -> TrainOutput:
        """One training forward on a device batch (`input_ids`, `position_ids`, `labels`, and
        `document_ids` for packed samples). Inside kernels.loss_per_row() a fused loss is one
        sum per row ([B]; preference training's sequence log-probabilities)."""

    def after_optimizer_step(self, all_reduce: AllReduce) -> None:
        """Run after every optimizer step (e.g. MoE load-balancing bias updates)."""

    # -- pipeline stages -------------------------------------------------------------------

    # (the blocks' ModuleList, the first stage's modules, the last stage's), as dotted names;
    # None: the backend cannot be split into pipeline stages.
    pipeline_modules: ClassVar[tuple[str, tuple[str, ...], tuple[str, ...]] | None] = None

    def keep_parts(self, parts: list[Part]) -> None:
        """Cut the meta-device model to the pipeline stages this rank runs (models/stage.py)."""
        if self.pipeline_modules is None:
            from titanite.core.errors import UserError

            raise UserError(f"parallelism.pp > 1: model.spec = '{self.backend}' cannot be split into pipeline stages")
        self._whole = {"params": self.num_params()}
        if self.lora is not None:
            self._whole["lora"] = self._lora_counts()
        keep_parts(self.module, *self.pipeline_modules, parts)
        self.stage_parts = parts
        if self.lora is not None:  # the adapters of the blocks this rank holds
            held = {name for name, _ in self.module.named_parameters()}
            every = self.lora.all_targets
            self.lora = Lora(self.lora.cfg, [t for t in every if t.a in held], every)

    def forward_part(self, x: torch.Tensor, batch: dict[str, torch.Tensor], part: Part) -> torch.Tensor:
        """One pipeline stage's training forward: `x` the micro-batch's input_ids (first stage) or
        the previous stage's hidden states; the hidden states out, or on the last stage the
        summed cross-entropy (the logits when loss_from_logits). Through the module's own call,
        so the hooks on it (FSDP's) run."""
        labels = batch["labels"] if part.last and not self.loss_from_logits else None
        return self.module(x, position_ids=batch["position_ids"], document_ids=batch.get("document_ids"),
                           labels=labels, part=part)

    def routing(self, layers: range) -> list[tuple[int, Any]]:
        """(layer index, RoutingRecord) of the MoE blocks among `layers`, from their last forward."""
        return []

"""ModelSpec: the one place a backend plugs in.

A spec builds the model on the meta device, initialises or loads it, maps its state dict to the
Hugging Face layout, parallelises it and counts its FLOPs. The trainer only talks to this
interface, so adding a backend touches no trainer code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from titanite.checkpoint.hf_weights import StateDictAdapter, check_hf_weights
from titanite.config import ModelConfig
from titanite.errors import UserError, did_you_mean


@dataclass
class TrainOutput:
    """What one training forward returns to the trainer."""

    logits: torch.Tensor | None  # [B, S, V]; None when loss_sum is given
    aux_loss: torch.Tensor | None = None  # already scaled by its coefficient; added to the loss
    stats: dict[str, float] = field(default_factory=dict)  # telemetry (e.g. expert load), logged
    # fp32 cross-entropy summed over the batch's valid labels, when the model computes it itself
    # (the `loss` kernel op, without materialising the logits); the trainer then skips its own.
    loss_sum: torch.Tensor | None = None


class ModelSpec(ABC):
    name: str
    # True when forward_train honours batch["document_ids"] (attention kept inside each packed
    # sample). The trainer refuses data.packing = 'documents' otherwise, rather than letting
    # packed samples silently attend to each other.
    supports_document_masks: bool = False

    @abstractmethod
    def build(self, cfg: ModelConfig) -> nn.Module:
        """The model on the meta device. Its `forward(input_ids, position_ids=None)` returns
        logits [B, S, V]. The architecture comes from cfg.hf_path's config.json when set."""

    @abstractmethod
    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        """The config.json dict an HF export of this model carries."""

    @abstractmethod
    def init_weights(self, model: nn.Module, std: float) -> None:
        """Random init of a materialised model (the caller seeds the RNG)."""

    @abstractmethod
    def init_buffers(self, model: nn.Module) -> None:
        """Recompute non-persistent buffers (e.g. RoPE inv_freq) after materialising/loading."""

    @abstractmethod
    def state_dict_adapter(self, model: nn.Module) -> StateDictAdapter:
        """The mapping between this model's state-dict keys and the Hugging Face on-disk keys."""

    @abstractmethod
    def load_hf(self, model: nn.Module, folder: str) -> None:
        """Copy weights from a local HF folder into the materialised model. Errors name file and tensor."""

    def check_hf(self, model: nn.Module, folder: str) -> None:
        """Every check load_hf makes before reading data (names, shapes, dtypes), on the meta model."""
        check_hf_weights(model, self.state_dict_adapter(model), folder)

    @abstractmethod
    def hf_state_dict(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF key, full tensor) pairs in the on-disk Hub layout, one at a time."""

    @abstractmethod
    def flops_per_token(self, model: nn.Module, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, attention included."""

    def forward_train(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> TrainOutput:
        """One training forward on a device batch (`input_ids`, `position_ids`, and optional keys
        such as `document_ids` for packed samples). Backends with auxiliary losses or telemetry
        override this."""
        return TrainOutput(model(batch["input_ids"], position_ids=batch["position_ids"]))

    def attach_kernels(self, model: nn.Module, cfg: Any, device_type: str, dtype: torch.dtype) -> dict[str, str]:
        """Bind the model's kernel call sites from the `[kernels]` table (cfg: KernelsConfig);
        returns {call site: "op:implementation"}. Backends whose modules hold no call sites of
        their own add them here first."""
        from titanite.kernels import attach

        return attach(model, cfg.select, device_type, dtype, cfg.fallback)

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Hook run after every optimizer step (e.g. MoE load-balancing bias updates)."""

    def parallelize(self, model: nn.Module, mesh: Any, cfg: Any) -> nn.Module:
        """Apply parallelism from outside the model. Single-process default: nothing to do."""
        return model

    def num_params(self, model: nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())


_SPECS: dict[str, ModelSpec] = {}


def register_spec(spec: ModelSpec) -> ModelSpec:
    assert spec.name not in _SPECS, f"spec {spec.name} registered twice"
    _SPECS[spec.name] = spec
    return spec


def get_spec(name: str) -> ModelSpec:
    _load_builtin_specs()
    if name not in _SPECS:
        raise UserError(f"config key 'model.spec': unknown spec '{name}'{did_you_mean(name, _SPECS)}; "
                        f"specs: {', '.join(sorted(_SPECS))}")
    return _SPECS[name]


def _load_builtin_specs() -> None:
    # Imported lazily: each backend module registers itself on import.
    import titanite.models.qwen3.spec  # noqa: F401
    try:
        import titanite.models.hf.spec  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name not in ("titanite.models.hf", "titanite.models.hf.spec"):
            raise

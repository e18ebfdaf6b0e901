"""LoRA for the transformers backend: peft's own LoRA layers, injected into the model.

`peft.inject_adapter_in_model` wraps the targeted nn.Linear modules (peft's lora.Linear, the
base under `.base_layer`) and, for MoE experts, the fused parameters (`target_parameters`,
peft's ParamWrapper) in place, so the model stays a transformers model under titanite's
wrapper and every other piece (kernels, FSDP, checkpointing) sees the modules it knows.

peft stores an experts adapter as lora_A [E*r, in], row e*r + j for expert e, and lora_B
[out, r*E], column j*E + e; `LoraTarget`'s converters turn them into the canonical
[E, r, in] and [E, out, r].
"""

from __future__ import annotations

import torch
from torch import nn

from titanite.core.config import LoraConfig
from titanite.models.lora import EXPERT_TARGETS, LINEAR_TARGETS, LoraTarget, base_key, check_dropout, chosen_targets

ADAPTER_NAME = "default"  # peft's name for a model's only adapter


def available(hf: nn.Module) -> set[str]:
    """The target_modules names this transformers Qwen3 / Qwen3-MoE has."""
    names = set()
    for layer in hf.model.layers:
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in LINEAR_TARGETS and isinstance(module, nn.Linear) and ".experts" not in name:
                names.add(leaf)
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj"):
            names.update(EXPERT_TARGETS)
    return names


def peft_config(cfg: LoraConfig, wanted: set[str], base_path: str = ""):
    """peft's LoraConfig for these targets (what the adapter folder's adapter_config.json holds)."""
    import peft

    modules = sorted(n for n in wanted if n in LINEAR_TARGETS)
    params = sorted(f"mlp.{n}" for n in wanted if n in EXPERT_TARGETS)
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=modules or None, target_parameters=params or None,
                           init_lora_weights=True if cfg.init == "kaiming" else "gaussian",
                           base_model_name_or_path=base_path or None, bias="none")


def _experts_converters(e: int):
    def a_canonical(a: torch.Tensor) -> torch.Tensor:  # [E*r, in] -> [E, r, in]
        return a.reshape(e, -1, a.shape[-1])

    def a_backend(a: torch.Tensor) -> torch.Tensor:
        return a.reshape(-1, a.shape[-1])

    def b_canonical(b: torch.Tensor) -> torch.Tensor:  # [out, r*E] (rank-major) -> [E, out, r]
        return b.reshape(b.shape[0], -1, e).permute(2, 0, 1)

    def b_backend(b: torch.Tensor) -> torch.Tensor:  # [E, out, r] -> [out, r*E]
        return b.permute(1, 2, 0).reshape(b.shape[1], -1)

    return {"a_canonical": a_canonical, "a_backend": a_backend, "b_canonical": b_canonical, "b_backend": b_backend}


def apply(wrapper: nn.Module, cfg: LoraConfig) -> list[LoraTarget]:
    """Inject peft's adapters into the (meta-device) transformers model held by `wrapper`
    (HFCausalLM, whose state-dict keys start with `hf.`); returns the targets in a fixed order."""
    import peft
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    hf = wrapper.hf
    wanted = chosen_targets(cfg, available(hf))
    check_dropout(cfg, wanted)  # before peft, which raises its own ValueError
    peft.inject_adapter_in_model(peft_config(cfg, wanted), hf, adapter_name=ADAPTER_NAME)
    targets: list[LoraTarget] = []
    for name, module in hf.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        a = f"hf.{name}.lora_A.{ADAPTER_NAME}.weight"
        b = f"hf.{name}.lora_B.{ADAPTER_NAME}.weight"
        if isinstance(module, ParamWrapper):
            param = module.parameter_name
            experts_path = base_key(name)  # ...mlp.experts (wrappers nest for two parameters)
            base_module, base_name = module, name
            while isinstance(base_module, ParamWrapper):  # the experts module under the wrappers
                base_module, base_name = base_module.base_layer, f"{base_name}.base_layer"
            targets.append(LoraTarget(f"{experts_path}.{param}", f"hf.{base_name}.{param}", a, b, experts=True,
                                      peft_module=name, **_experts_converters(getattr(base_module, param).shape[0])))
        else:
            targets.append(LoraTarget(name, f"hf.{name}.base_layer.weight", a, b, peft_module=name))
    targets.sort(key=lambda t: _order(t.key))
    return targets


def _order(key: str) -> tuple:
    """Layer, then a fixed order of projections (the native table's)."""
    parts = key.split(".")
    layer = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1
    leaf = ".".join(parts[-2:]) if ".experts." in key else parts[-1]
    order = [*LINEAR_TARGETS, *EXPERT_TARGETS]
    return layer, order.index(leaf)
